// TileScale device runtime: everything.  The generated kernels include this one header.
#pragma once
#include "common.cuh"
#include "memory.cuh"
#include "copy.cuh"
#include "wait.cuh"
#include "signal.cuh"
#include "atomic.cuh"
#include "barrier.cuh"
#include "barrier1.cuh"
#include "team.cuh"
#include "multimem.cuh"
#include "profiler.cuh"
#include "host.cuh"
