// TileScale device runtime: spin waits on 32- and 64-bit flags, with an opt-in timeout.
#pragma once
#include "common.cuh"
#include "memory.cuh"

#if TILESCALE_WAIT_TIMEOUT_MS > 0 && !defined(__CUDACC_RTC__)
#include <cstdio>  // device printf (NVRTC declares it itself)
#endif

namespace tilescale {

template <Cmp C, typename T> TILESCALE_DEVICE bool compare(T observed, T expected) {
  if constexpr (C == Cmp::EQ) return observed == expected;
  else if constexpr (C == Cmp::NE) return observed != expected;
  else if constexpr (C == Cmp::GE) return observed >= expected;
  else if constexpr (C == Cmp::LE) return observed <= expected;
  else if constexpr (C == Cmp::GT) return observed > expected;
  else return observed < expected;
}

#if TILESCALE_WAIT_TIMEOUT_MS > 0
/// Report a wait that exceeded TILESCALE_WAIT_TIMEOUT_MS, then trap (the host sees a CUDA
/// error instead of a hang).
template <typename T>
__device__ __noinline__ void wait_timeout(const char* what, const void* ptr, T expected, T observed) {
  printf("[tilescale] %s timed out after %d ms: rank %d block (%d,%d,%d) thread (%d,%d,%d) "
         "address %p expected %llu (0x%llx) observed %llu (0x%llx)\n",
         what, (int)TILESCALE_WAIT_TIMEOUT_MS, (int)meta_data[0], (int)blockIdx.x, (int)blockIdx.y,
         (int)blockIdx.z, (int)threadIdx.x, (int)threadIdx.y, (int)threadIdx.z, ptr,
         (unsigned long long)expected, (unsigned long long)expected,
         (unsigned long long)observed, (unsigned long long)observed);
  __trap();
}
#define TILESCALE_WAIT_PROLOGUE                                                            \
  const unsigned long long ts_start_ = global_timer_ns();                                 \
  unsigned int ts_iter_ = 0;
#define TILESCALE_WAIT_CHECK(WHAT, PTR, EXPECTED, OBSERVED)                                \
  if (((++ts_iter_) & 255u) == 0u &&                                                       \
      global_timer_ns() - ts_start_ > (unsigned long long)TILESCALE_WAIT_TIMEOUT_MS * 1000000ull) \
    wait_timeout(WHAT, PTR, EXPECTED, OBSERVED);
#else
#define TILESCALE_WAIT_PROLOGUE
#define TILESCALE_WAIT_CHECK(WHAT, PTR, EXPECTED, OBSERVED)
#endif

/// Spin until `*ptr CMP expected` holds; each poll is an ld.acquire.{gpu,sys} (M == ACQUIRE)
/// or an ld.volatile (M == VOLATILE).  Returns the value observed.
template <Cmp C, Scope S, Sem M, typename T>
TILESCALE_DEVICE value_t<T> wait_until(const T* ptr, value_t<T> expected) {
  static_assert(M == Sem::ACQUIRE || M == Sem::VOLATILE, "wait semantics: acquire or volatile");
  static_assert(S == Scope::GPU || S == Scope::SYS, "wait scope: gpu or sys");
  TILESCALE_WAIT_PROLOGUE
#pragma unroll 1
  while (true) {
    value_t<T> v = ld<S, M, false, false, T>(ptr);
    if (compare<C, value_t<T>>(v, expected)) return v;
    TILESCALE_WAIT_CHECK("wait", ptr, expected, v)
  }
}

/// wait_until on the symmetric counterpart of ptr on rank pe (-1: local).
template <Cmp C, Scope S, Sem M, typename T>
TILESCALE_DEVICE value_t<T> wait_until(const T* ptr, value_t<T> expected, int pe) {
  return wait_until<C, S, M, T>(remap(ptr, pe), expected);
}

}  // namespace tilescale
