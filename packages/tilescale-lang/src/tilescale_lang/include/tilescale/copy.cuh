// TileScale device runtime: peer copies (put/get) at thread, warp and block scope.
// Sizes are in bytes.  The body moves 16-byte vectors when both addresses allow it (or
// always, with AGGRESSIVE), then 8/4-byte words, and finishes with a byte tail, so any size
// is exact.
#pragma once
#include "common.cuh"

namespace tilescale {

typedef uint4 vec16;  // 16-byte vector (CUDA builtin vector type)

// Cooperative copy of `bytes` bytes by `nthreads` threads; `tid` is this thread's index.
// UNROLL independent loads are issued before their stores.
template <int UNROLL, bool AGGRESSIVE>
TILESCALE_DEVICE void coop_copy(void* dst, const void* src, unsigned long long bytes,
                                unsigned int tid, unsigned int nthreads) {
  static_assert(UNROLL >= 1, "unroll_factor must be >= 1");
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  unsigned long long done = 0;
  const unsigned long long mis =
      (reinterpret_cast<unsigned long long>(d) | reinterpret_cast<unsigned long long>(s));
  if (AGGRESSIVE || (mis & 15ull) == 0) {
    const unsigned long long n = bytes >> 4;
    vec16* dv = reinterpret_cast<vec16*>(d);
    const vec16* sv = reinterpret_cast<const vec16*>(s);
    unsigned long long i = tid;
    const unsigned long long stride = static_cast<unsigned long long>(nthreads);
    for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
      vec16 r[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) r[u] = sv[i + u * stride];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) dv[i + u * stride] = r[u];
    }
    for (; i < n; i += stride) dv[i] = sv[i];
    done = n << 4;
  } else if ((mis & 7ull) == 0) {
    const unsigned long long n = bytes >> 3;
    unsigned long long* dv = reinterpret_cast<unsigned long long*>(d);
    const unsigned long long* sv = reinterpret_cast<const unsigned long long*>(s);
    for (unsigned long long i = tid; i < n; i += nthreads) dv[i] = sv[i];
    done = n << 3;
  } else if ((mis & 3ull) == 0) {
    const unsigned long long n = bytes >> 2;
    unsigned int* dv = reinterpret_cast<unsigned int*>(d);
    const unsigned int* sv = reinterpret_cast<const unsigned int*>(s);
    for (unsigned long long i = tid; i < n; i += nthreads) dv[i] = sv[i];
    done = n << 2;
  }
  // Scalar tail (and the whole copy for byte-aligned addresses).
  for (unsigned long long i = done + tid; i < bytes; i += nthreads) d[i] = s[i];
}

/// Warp-scope copy: every lane of the warp calls it with the same arguments.
template <int UNROLL, bool AGGRESSIVE>
TILESCALE_DEVICE void copy_warp(void* dst, const void* src, unsigned long long bytes) {
  coop_copy<UNROLL, AGGRESSIVE>(dst, src, bytes, thread_rank() & 31u, 32u);
}

/// Block-scope copy: every thread of the block calls it with the same arguments.
template <int UNROLL, bool AGGRESSIVE>
TILESCALE_DEVICE void copy_block(void* dst, const void* src, unsigned long long bytes) {
  coop_copy<UNROLL, AGGRESSIVE>(dst, src, bytes, thread_rank(), block_size());
}

/// Warp-scope put: copy `bytes` bytes from local `src` to `dst` on rank `dst_pe` (-1: local).
template <int UNROLL, bool AGGRESSIVE>
TILESCALE_DEVICE void put_warp(const void* src, void* dst, unsigned long long bytes, int dst_pe) {
  copy_warp<UNROLL, AGGRESSIVE>(remap(dst, dst_pe), src, bytes);
}

/// Warp-scope get: copy `bytes` bytes from `src` on rank `src_pe` (-1: local) to local `dst`.
template <int UNROLL, bool AGGRESSIVE>
TILESCALE_DEVICE void get_warp(const void* src, void* dst, unsigned long long bytes, int src_pe) {
  copy_warp<UNROLL, AGGRESSIVE>(dst, remap(src, src_pe), bytes);
}

/// Block-scope put (all threads of the block participate).
template <int UNROLL>
TILESCALE_DEVICE void put_block(const void* src, void* dst, unsigned long long bytes, int dst_pe) {
  copy_block<UNROLL, false>(remap(dst, dst_pe), src, bytes);
}

/// Block-scope get (all threads of the block participate).
template <int UNROLL>
TILESCALE_DEVICE void get_block(const void* src, void* dst, unsigned long long bytes, int src_pe) {
  copy_block<UNROLL, false>(dst, remap(src, src_pe), bytes);
}

}  // namespace tilescale
