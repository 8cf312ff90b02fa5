// TileScale device runtime: peer copies (put/get) at thread, warp and block scope.
// Sizes are in bytes.  The body moves 16-byte vectors when both addresses allow it (or
// always, with AGGRESSIVE), then 8/4-byte words, and finishes with a byte tail, so any size
// is exact.
#pragma once
#include "common.cuh"

namespace tilescale {

typedef uint4 vec16;  // 16-byte vector (CUDA builtin vector type)

// Copy n words of type W: thread `tid` of `nthreads` moves words tid, tid + nthreads, ...
// UNROLL independent loads are issued before their stores, in full rounds and then in one
// predicated round for the fewer than UNROLL words a thread has left (so a copy shorter than
// a full round, e.g. 7 vectors per lane with UNROLL = 8, still has all its loads in flight
// at once instead of one load-store latency per word).  Pointers advance by a stride instead
// of being recomputed from a 64-bit index, which keeps the register count low enough for two
// 512-thread blocks per SM (checked by the CPU suite with ptxas -v).
template <typename W, int UNROLL>
TILESCALE_DEVICE void copy_words(void* dst, const void* src, unsigned long long n,
                                 unsigned int tid, unsigned int nthreads) {
  W* d = static_cast<W*>(dst) + tid;
  const W* s = static_cast<const W*>(src) + tid;
  const W* const end = static_cast<const W*>(src) + n;  // no division: compare addresses
  const unsigned long long last = static_cast<unsigned long long>(UNROLL - 1) * nthreads;
#pragma unroll 1
  for (; s + last < end; s += UNROLL * nthreads, d += UNROLL * nthreads) {
    W r[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) r[u] = s[u * nthreads];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) d[u * nthreads] = r[u];
  }
  // Tail round: words s, s + nthreads, ... below end (at most UNROLL - 1 of them; none when
  // UNROLL is 1, whose loop above moved every word).
  W r[UNROLL > 1 ? UNROLL - 1 : 1];
#pragma unroll
  for (int u = 0; u < UNROLL - 1; ++u)
    if (s + static_cast<unsigned long long>(u) * nthreads < end) r[u] = s[u * nthreads];
#pragma unroll
  for (int u = 0; u < UNROLL - 1; ++u)
    if (s + static_cast<unsigned long long>(u) * nthreads < end) d[u * nthreads] = r[u];
}

// Cooperative copy of `bytes` bytes by `nthreads` threads; `tid` is this thread's index.
// The widest word both addresses allow (16 bytes always with AGGRESSIVE), then a byte tail.
template <int UNROLL, bool AGGRESSIVE>
TILESCALE_DEVICE void coop_copy(void* dst, const void* src, unsigned long long bytes,
                                unsigned int tid, unsigned int nthreads) {
  static_assert(UNROLL >= 1, "unroll_factor must be >= 1");
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const unsigned long long mis =
      (reinterpret_cast<unsigned long long>(d) | reinterpret_cast<unsigned long long>(s));
  unsigned long long done = 0;
  if (AGGRESSIVE || (mis & 15ull) == 0) {
    copy_words<vec16, UNROLL>(d, s, bytes >> 4, tid, nthreads);
    done = bytes & ~15ull;
  } else if ((mis & 7ull) == 0) {
    copy_words<unsigned long long, UNROLL>(d, s, bytes >> 3, tid, nthreads);
    done = bytes & ~7ull;
  } else if ((mis & 3ull) == 0) {
    copy_words<unsigned int, UNROLL>(d, s, bytes >> 2, tid, nthreads);
    done = bytes & ~3ull;
  }
  // Byte tail (and the whole copy for byte-aligned addresses).
#pragma unroll 1
  for (unsigned long long i = done + tid; i < bytes; i += nthreads) d[i] = s[i];
}

// Copy `rows` rows of `row_words` words of type W: row r from src + r * src_stride to
// dst + r * dst_stride (strides in words).  The rows are taken end to end as one sequence of
// words; thread `tid` of `nthreads` moves words tid, tid + nthreads, ..., UNROLL loads before
// their stores, so rows shorter than a round (1 KiB rows of an all-to-all's head slices) keep
// every thread's loads in flight instead of one load-store latency per row.  A thread's
// pointers advance by fixed steps (a word nthreads further on, plus the gap to the next row
// when its column wraps): one division per thread, none per word, and the store round steps
// the destination again rather than keeping UNROLL addresses in registers.
template <typename W, int UNROLL>
TILESCALE_DEVICE void copy_rows_words(W* dst, const W* src, unsigned long long rows, unsigned long long row_words,
                                      unsigned long long dst_stride, unsigned long long src_stride,
                                      unsigned int tid, unsigned int nthreads) {
  if (rows == 0 || row_words == 0) return;
  const unsigned long long total = rows * row_words;
  const unsigned long long dcol = nthreads % row_words, drow = nthreads / row_words;
  const long long s_step = static_cast<long long>(drow * src_stride + dcol);
  const long long d_step = static_cast<long long>(drow * dst_stride + dcol);
  const long long s_wrap = static_cast<long long>(src_stride - row_words);
  const long long d_wrap = static_cast<long long>(dst_stride - row_words);
  unsigned long long col = tid % row_words;
  const W* s = src + (tid / row_words) * src_stride + col;
  W* d = dst + (tid / row_words) * dst_stride + col;
#pragma unroll 1
  for (unsigned long long i = tid; i < total; i += static_cast<unsigned long long>(UNROLL) * nthreads) {
    W r[UNROLL];
    const unsigned long long col0 = col;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (i + static_cast<unsigned long long>(u) * nthreads < total) r[u] = *s;
      s += s_step;
      col += dcol;
      if (col >= row_words) {
        col -= row_words;
        s += s_wrap;
      }
    }
    col = col0;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (i + static_cast<unsigned long long>(u) * nthreads < total) *d = r[u];
      d += d_step;
      col += dcol;
      if (col >= row_words) {
        col -= row_words;
        d += d_wrap;
      }
    }
  }
}

// copy_rows_words on words of type W, the sizes and strides given in bytes (multiples of W).
template <typename W, int UNROLL>
TILESCALE_DEVICE void copy_rows_as(void* dst, const void* src, unsigned long long rows, unsigned long long row_bytes,
                                   unsigned long long dst_stride, unsigned long long src_stride, unsigned int tid,
                                   unsigned int nthreads) {
  copy_rows_words<W, UNROLL>(static_cast<W*>(dst), static_cast<const W*>(src), rows, row_bytes / sizeof(W),
                             dst_stride / sizeof(W), src_stride / sizeof(W), tid, nthreads);
}

// Cooperative strided copy (all sizes in bytes): the widest word (16, 8, 4, 2 or 1 bytes) that
// divides both addresses, the row size and both strides.
template <int UNROLL>
TILESCALE_DEVICE void coop_copy_rows(void* dst, const void* src, unsigned long long rows, unsigned long long row_bytes,
                                     unsigned long long dst_stride, unsigned long long src_stride,
                                     unsigned int tid, unsigned int nthreads) {
  static_assert(UNROLL >= 1, "unroll_factor must be >= 1");
  const unsigned long long mis = reinterpret_cast<unsigned long long>(dst) |
                                 reinterpret_cast<unsigned long long>(src) | row_bytes | dst_stride | src_stride;
  if ((mis & 15ull) == 0) {
    copy_rows_as<vec16, UNROLL>(dst, src, rows, row_bytes, dst_stride, src_stride, tid, nthreads);
  } else if ((mis & 7ull) == 0) {
    copy_rows_as<unsigned long long, UNROLL>(dst, src, rows, row_bytes, dst_stride, src_stride, tid, nthreads);
  } else if ((mis & 3ull) == 0) {
    copy_rows_as<unsigned int, UNROLL>(dst, src, rows, row_bytes, dst_stride, src_stride, tid, nthreads);
  } else if ((mis & 1ull) == 0) {
    copy_rows_as<unsigned short, UNROLL>(dst, src, rows, row_bytes, dst_stride, src_stride, tid, nthreads);
  } else {
    copy_rows_as<unsigned char, UNROLL>(dst, src, rows, row_bytes, dst_stride, src_stride, tid, nthreads);
  }
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

/// Block-scope strided put: `rows` rows of `row_bytes` bytes, row r from local
/// src + r * src_stride to dst + r * dst_stride on rank `dst_pe` (-1: local); strides in bytes.
template <int UNROLL>
TILESCALE_DEVICE void put_rows_block(const void* src, void* dst, unsigned long long rows, unsigned long long row_bytes,
                                     unsigned long long src_stride, unsigned long long dst_stride, int dst_pe) {
  coop_copy_rows<UNROLL>(remap(dst, dst_pe), src, rows, row_bytes, dst_stride, src_stride, thread_rank(),
                         block_size());
}

/// Block-scope strided get: rows from `src` on rank `src_pe` (-1: local) into local `dst`.
template <int UNROLL>
TILESCALE_DEVICE void get_rows_block(const void* src, void* dst, unsigned long long rows, unsigned long long row_bytes,
                                     unsigned long long src_stride, unsigned long long dst_stride, int src_pe) {
  coop_copy_rows<UNROLL>(dst, remap(src, src_pe), rows, row_bytes, dst_stride, src_stride, thread_rank(),
                         block_size());
}

}  // namespace tilescale
