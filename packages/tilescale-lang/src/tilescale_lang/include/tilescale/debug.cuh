// TileScale device runtime: checks compiled in with TILESCALE_DEBUG=1 (environment variable,
// read at compile time and part of the kernel cache key); zero cost when off.
#pragma once
#include "common.cuh"

#ifndef TILESCALE_DEBUG
#define TILESCALE_DEBUG 0
#endif

#if (TILESCALE_DEBUG || TILESCALE_CHECK_PE) && !defined(__CUDACC_RTC__)
#include <cstdio>  // device printf (NVRTC declares it itself)
#endif

namespace tilescale {

#if TILESCALE_DEBUG || TILESCALE_CHECK_PE
/// A remote TMA operation got a PE its descriptors do not cover (outside 0..7 or beyond the
/// group, or negative but not -1): say so and trap instead of issuing nothing (which stalls a
/// load on its mbarrier).  Compiled in by TILESCALE_CHECK_PE=1 or TILESCALE_DEBUG=1.
__device__ __noinline__ void tma_bad_pe(int pe) {
  printf("[tilescale] remote TMA: PE %d is outside the PEs 0..7 that have descriptors, or not below "
         "num_ranks %d: rank %d block (%d,%d,%d) thread (%d,%d,%d)\n",
         pe, get_num_ranks(), get_rank(), (int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z,
         (int)threadIdx.x, (int)threadIdx.y, (int)threadIdx.z);
  __trap();
}
#else
/// Without TILESCALE_CHECK_PE / TILESCALE_DEBUG a remote TMA operation with such a PE issues
/// no operation.
TILESCALE_DEVICE void tma_bad_pe(int) {}
#endif

}  // namespace tilescale
