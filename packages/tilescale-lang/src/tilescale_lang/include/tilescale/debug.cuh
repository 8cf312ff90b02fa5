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

#if TILESCALE_DEBUG || TILESCALE_CHECK_PE
/// Trap: a signed run-time element count (`what`: the intrinsic and its size argument, e.g.
/// "put_block size") is negative; as a uint64 byte count it would be near 2**64 and the copy
/// would run off the end of memory.  Compiled in by TILESCALE_CHECK_PE=1 or TILESCALE_DEBUG=1.
static __device__ __noinline__ void negative_count_trap(const char* what, long long n) {
  printf("[tilescale] %s = %lld is negative: an element count must be >= 0; rank %d block "
         "(%d,%d,%d) thread (%d,%d,%d)\n",
         what, n, (int)meta_data[0], (int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z,
         (int)threadIdx.x, (int)threadIdx.y, (int)threadIdx.z);
  __trap();
}
#endif

/// The signed run-time element count `n` of `what` (the intrinsic and its size argument), which
/// the generated code then converts to a uint64 byte count.  With TILESCALE_CHECK_PE=1 or
/// TILESCALE_DEBUG=1 a negative `n` traps (negative_count_trap); otherwise `n` is returned as
/// is, at no cost: a negative count is not clamped, it stays undefined (a huge byte count), as
/// docs/reliability.md says.  Emitted by size_bytes() for signed sizes only.
template <typename T> TILESCALE_DEVICE T checked_count(T n, const char* what) {
#if TILESCALE_DEBUG || TILESCALE_CHECK_PE
  if (n < 0) negative_count_trap(what, static_cast<long long>(n));
#else
  (void)what;
#endif
  return n;
}

}  // namespace tilescale
