// TileScale host-side setter for the cython backend, whose shared library contains the
// kernel and its host wrapper in one translation unit: kernel.initialize() calls it through
// ctypes.  Compiled out under NVRTC and harmless in device-only (cubin) builds.
#pragma once
#include "common.cuh"

#if !defined(__CUDACC_RTC__)
extern "C" __attribute__((visibility("default"))) int tilescale_set_meta_data(
    const unsigned long long* table, int n, void* stream) {
  if (n < 0 || n > TILESCALE_MAX_TABLE) return 1;  // cudaErrorInvalidValue
  return static_cast<int>(cudaMemcpyToSymbolAsync(meta_data, table, sizeof(unsigned long long) * n, 0,
                                                  cudaMemcpyHostToDevice,
                                                  static_cast<cudaStream_t>(stream)));
}
#endif
