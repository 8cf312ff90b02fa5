// TileScale device runtime: the Lamport exchange of 16-byte vectors whose data carries its own
// readiness (no flag, no fence).
//
// A receive buffer starts filled with the sentinel: every element all ones (a NaN in float16,
// bfloat16, float32 and float64). lamport_put stores one 16-byte vector, any element equal
// to the sentinel replaced by the type's canonical quiet NaN (NAN_BITS: still a NaN, so sums
// stay NaN); lamport_get polls one vector with ld.volatile until none of its elements is the
// sentinel, so the reader sees the data itself arrive; lamport_clear writes the sentinel back
// before the buffer is used again. A 16-byte aligned vector store is seen whole or element
// by element; checking every element covers both. The buffer must not be reused before every
// reader is done with it: the caller rotates buffers (three suffice when every call of a rank
// is a kernel after the previous one: call e clears the buffer of call e - 1).
#pragma once
#include "common.cuh"
#include "memory.cuh"
#include "wait.cuh"

namespace tilescale {

/// Whether no ESIZE-byte element of the 16-byte vector v is all ones (the sentinel).
template <int ESIZE> TILESCALE_DEVICE bool lamport_ready(uint4 v) {
  static_assert(ESIZE == 2 || ESIZE == 4 || ESIZE == 8, "Lamport elements are 2, 4 or 8 bytes");
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
  bool ready = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (ESIZE == 2) ready &= (w[i] & 0xffffu) != 0xffffu && (w[i] >> 16) != 0xffffu;
    else if constexpr (ESIZE == 4) ready &= w[i] != 0xffffffffu;
    else if (i % 2 == 0) ready &= (w[i] & w[i + 1]) != 0xffffffffu;
  }
  return ready;
}

/// v with every all-ones ESIZE-byte element replaced by NAN_BITS.
template <int ESIZE, unsigned long long NAN_BITS> TILESCALE_DEVICE uint4 lamport_encode(uint4 v) {
  unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (ESIZE == 2) {
      if ((w[i] & 0xffffu) == 0xffffu) w[i] = (w[i] & 0xffff0000u) | (unsigned int)NAN_BITS;
      if ((w[i] >> 16) == 0xffffu) w[i] = (w[i] & 0xffffu) | ((unsigned int)NAN_BITS << 16);
    } else if constexpr (ESIZE == 4) {
      if (w[i] == 0xffffffffu) w[i] = (unsigned int)NAN_BITS;
    } else if (i % 2 == 0 && (w[i] & w[i + 1]) == 0xffffffffu) {
      w[i] = (unsigned int)NAN_BITS;
      w[i + 1] = (unsigned int)(NAN_BITS >> 32);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// Store the 16 bytes at src (any memory, 16-byte aligned) to dst on rank pe (-1: local),
/// sentinel elements replaced by NAN_BITS.
template <int ESIZE, unsigned long long NAN_BITS, typename S, typename D>
TILESCALE_DEVICE void lamport_put(const S* src, D* dst, int pe) {
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  st_volatile_vec16(remap_ptr(dst, pe), lamport_encode<ESIZE, NAN_BITS>(v));
}

/// Poll the 16 bytes at src on rank pe (-1: local) until no element is the sentinel, then
/// write them to dst (any memory, 16-byte aligned). With TILESCALE_WAIT_TIMEOUT_MS, a poll
/// that exceeds it reports the rank, block, thread and address (and the first word seen), then
/// traps.
template <int ESIZE, typename S, typename D> TILESCALE_DEVICE void lamport_get(const S* src, D* dst, int pe) {
  const void* p = remap_ptr(src, pe);
  TILESCALE_WAIT_PROLOGUE
  uint4 v;
#pragma unroll 1
  while (true) {
    v = ld_volatile_vec16(p);
    if (lamport_ready<ESIZE>(v)) break;
    TILESCALE_WAIT_CHECK("lamport_get", p, 0ull, (unsigned long long)v.x)
  }
  *reinterpret_cast<uint4*>(dst) = v;
}

/// Write the sentinel (16 bytes of all ones) to dst on rank pe (-1: local).
template <typename D> TILESCALE_DEVICE void lamport_clear(D* dst, int pe) {
  store_vec16(remap_ptr(dst, pe), make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu));
}

}  // namespace tilescale
