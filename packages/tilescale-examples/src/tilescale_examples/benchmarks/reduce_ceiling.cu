// Device code of tilescale_examples.benchmarks.reduce_ceiling: the reduction engine's data loop
// and flag rounds (and a plain copy in the same loop) written directly in CUDA, run as rank 0 of W emulated ranks whose regions'
// base addresses are in `ceiling_bases` (region p: W shards of `span` 16-byte rows, then the
// flag words at byte offset `flag_off`). The Python side appends one extern "C" wrapper per
// variant (ts_ceiling_<op>_<W>_<U>_<TH>_<rounds>_<flags>).
#include <cuda_fp16.h>
#include <stdint.h>

__constant__ unsigned long long ceiling_bases[8];

namespace ceiling {

__device__ __forceinline__ char* region(int p) { return reinterpret_cast<char*>(ceiling_bases[p]); }

__device__ __forceinline__ uint4 ld16(const char* a) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  return v;
}
__device__ __forceinline__ void st16(char* a, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* a, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(uint64_t* a, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* a) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
  return v;
}

/// Flag word `index` (uint64 words, 4 per 32-byte sector as in the engine) of region p.
__device__ __forceinline__ uint64_t* flag(int p, unsigned long long flag_off, long long index) {
  return reinterpret_cast<uint64_t*>(region(p) + flag_off) + index * 4;
}

/// x_0 + x_1 + ... + x_{W-1} of eight float16 lanes in float32, rounded once (rank order).
template <int W> __device__ __forceinline__ uint4 rank_order_sum(const uint4* v) {
  float acc[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = 0.f;
#pragma unroll
  for (int p = 0; p < W; ++p) {
    const __half2* h = reinterpret_cast<const __half2*>(&v[p]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float2 f = __half22float2(h[k]);
      acc[2 * k] += f.x;
      acc[2 * k + 1] += f.y;
    }
  }
  uint4 r;
  __half2* o = reinterpret_cast<__half2*>(&r);
#pragma unroll
  for (int k = 0; k < 4; ++k) o[k] = __floats2half2_rn(acc[2 * k], acc[2 * k + 1]);
  return r;
}

/// One iteration t of the engine's loop: rows ((t * blocks + bx) * U + u) * TH + tx of shard 0,
/// W loads per row (all issued before the first add), then the sum stored to every region
/// (OP 0, two-shot) or to `out` (OP 1, reduce-scatter); OP 2 (copy, W = 1) stores the row of
/// region 0 to `out` unchanged. `own` (or null): the U rows of region 0 already loaded.
template <int W, int U, int TH, int OP>
__device__ __forceinline__ void iteration(char* out, int t, int blocks, long long span, const uint4* own) {
  const int tx = threadIdx.x, bx = blockIdx.x;
  uint4 v[U][W];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long r = ((long long)(t * blocks + bx) * U + u) * TH + tx;
    if (r < span) {
#pragma unroll
      for (int p = 0; p < W; ++p) v[u][p] = (p == 0 && own) ? own[u] : ld16(region(p) + r * 16);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long r = ((long long)(t * blocks + bx) * U + u) * TH + tx;
    if (r < span) {
      const uint4 sum = OP == 2 ? v[u][0] : rank_order_sum<W>(v[u]);
      if (OP == 0) {
#pragma unroll
        for (int p = 0; p < W; ++p) st16(region(p) + r * 16, sum);
      } else {
        st16(out + r * 16, sum);
      }
    }
  }
}

/// The kernel of one variant. ROUNDS: 0 none, 1 the ready round, 2 ready and closing rounds.
/// RANK_FLAG false: the engine's ready round (thread p < W of every block stores ready[0, b]
/// on rank p, relaxed, then polls ready[p, b] here with acquire loads). RANK_FLAG true: one
/// ready flag per rank (block 0 stores it; every block polls the W rank flags, the first poll
/// issued before the store) and the rows of iteration 0 in this rank's own region loaded
/// before the round. The closing round is the engine's: barrier, release store data[0, b] on
/// every rank, poll data[p, b] here.
template <int W, int U, int TH, int OP, int ROUNDS, bool RANK_FLAG>
__device__ __forceinline__ void body(char* out, unsigned long long flag_off, unsigned long long epoch, int blocks,
                                     int iters, long long span) {
  const int tx = threadIdx.x, bx = blockIdx.x;
  constexpr bool early = RANK_FLAG && ROUNDS >= 1;
  uint4 own[U];
  if (early) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long r = ((long long)bx * U + u) * TH + tx;
      if (r < span) own[u] = ld16(region(0) + r * 16);
    }
  }
  if (ROUNDS >= 1) {
    if (tx < W) {
      if (RANK_FLAG) {
        const long long rank_base = 2LL * W * blocks;
        const uint64_t first = ld_acquire_sys(flag(0, flag_off, rank_base + tx));
        if (bx == 0) st_relaxed_sys(flag(tx, flag_off, rank_base + 0), epoch);
        if (first < epoch) {
          while (ld_acquire_sys(flag(0, flag_off, rank_base + tx)) < epoch) {
          }
        }
      } else {
        st_relaxed_sys(flag(tx, flag_off, 0LL * blocks + bx), epoch);
        while (ld_acquire_sys(flag(0, flag_off, (long long)tx * blocks + bx)) < epoch) {
        }
      }
    }
    __syncthreads();
  }
  int t = 0;
  if (early && iters > 0) {
    iteration<W, U, TH, OP>(out, 0, blocks, span, own);
    t = 1;
  }
  for (; t < iters; ++t) iteration<W, U, TH, OP>(out, t, blocks, span, nullptr);
  if (ROUNDS >= 2) {
    __syncthreads();
    if (tx < W) {
      st_release_sys(flag(tx, flag_off, (long long)W * blocks + bx), epoch);
      while (ld_acquire_sys(flag(0, flag_off, (long long)(W + tx) * blocks + bx)) < epoch) {
      }
    }
    __syncthreads();
  }
}

}  // namespace ceiling
