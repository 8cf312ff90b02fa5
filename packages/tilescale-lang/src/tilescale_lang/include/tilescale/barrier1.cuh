// TileScale device runtime: the GPU barrier on ONE uint32 word (upstream TileScale's layout,
// `T.Tensor([1], T.uint32)`), with generation counting in that word.
//
//   bit 31       phase: flips once per completed generation
//   bits 30..16  the number of blocks taking part (1..32767), set by init_barrier_gpu1
//   bits 15..0   arrivals in the current generation
//
// Every block that takes part calls init_barrier_gpu1(bar, expected) before its first
// arrival (idempotent: it sets the count field once, with a compare-and-swap, and checks it
// afterwards).  An arrival adds 1 (acq_rel, gpu scope) and keeps the old word; the block that
// completes the generation adds 0x80000000 - expected (release), which clears the arrivals
// and flips the phase in one atomic.  Nobody can arrive for the next generation before that
// flip (every block waits for it first), so there is no reset race under repetition; waiters
// poll with ld.acquire.gpu until the phase differs from the one they arrived in.  The word
// must be zero before its first use and the same expected count used for its whole life.
#pragma once
#include "common.cuh"
#include "memory.cuh"
#include "wait.cuh"
#include "signal.cuh"
#include "barrier.cuh"

#if !defined(__CUDACC_RTC__)
#include <cstdio>  // device printf of the misuse report (NVRTC declares it itself)
#endif

namespace tilescale {

#define TILESCALE_BAR1_PHASE 0x80000000u
#define TILESCALE_BAR1_MAX 32767u

/// Misuse of a one-word barrier: print what was wrong (always: it is a programming error
/// that would otherwise hang or pass a barrier early) and trap.
__device__ __noinline__ void barrier1_misuse(const char* what, const void* bar, unsigned int word,
                                            unsigned int expected) {
  printf("[tilescale] one-word GPU barrier at %p: %s (word 0x%08x, expected blocks %u, block (%d,%d,%d))\n",
         bar, what, word, expected, (int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z);
  __trap();
}

TILESCALE_DEVICE unsigned int& barrier1_token() {
  __shared__ unsigned int token;
  return token;
}

/// Record `expected` (1..32767) blocks in the barrier word; every taking-part block calls it
/// before its first arrival.
TILESCALE_DEVICE void init_barrier_gpu1(unsigned int* bar, unsigned int expected) {
  if (thread_rank() == 0) {
    if (expected == 0u || expected > TILESCALE_BAR1_MAX)
      barrier1_misuse("expected block count outside 1..32767", bar, 0u, expected);
    unsigned int cur = ld<Scope::GPU, Sem::RELAXED, false, false>(bar);
#pragma unroll 1
    while (true) {
      const unsigned int field = (cur >> 16) & TILESCALE_BAR1_MAX;
      if (field == expected) break;
      if (field != 0u) barrier1_misuse("initialised with another block count", bar, cur, expected);
      const unsigned int prev = cas_word<Scope::GPU, Sem::RELAXED, unsigned int>(bar, cur, cur | (expected << 16));
      if (prev == cur) break;
      cur = prev;
    }
  }
  __syncthreads();
}

/// Arrive (acq_rel, gpu scope); the completing block flips the phase (release).
TILESCALE_DEVICE void arrive_barrier_gpu1(unsigned int* bar) {
  __syncthreads();
  if (thread_rank() == 0) {
    const unsigned int old = atom_add<Scope::GPU, Sem::ACQ_REL>(bar, 1u);
    const unsigned int expected = (old >> 16) & TILESCALE_BAR1_MAX;
    if (expected == 0u) barrier1_misuse("arrival before init_barrier_gpu", bar, old, 0u);
    if ((old & 0xFFFFu) + 1u == expected) atom_add<Scope::GPU, Sem::RELEASE>(bar, TILESCALE_BAR1_PHASE - expected);
    barrier1_token() = old;
  }
}

/// Wait until the generation this block arrived in completes (acquire, gpu scope).
TILESCALE_DEVICE void wait_barrier_gpu1(unsigned int* bar) {
  wait_phase_flip(bar, thread_rank() == 0 ? barrier1_token() : 0u);
}

/// arrive_barrier_gpu1 followed by wait_barrier_gpu1.
TILESCALE_DEVICE void sync_barrier_gpu1(unsigned int* bar) {
  arrive_barrier_gpu1(bar);
  wait_barrier_gpu1(bar);
}

// Any 32-bit storage (int, or const from TileLang's read-only parameters).
template <typename P> TILESCALE_DEVICE void init_barrier_gpu1(P* bar, unsigned int e) { init_barrier_gpu1((unsigned int*)(bar), e); }
template <typename P> TILESCALE_DEVICE void arrive_barrier_gpu1(P* bar) { arrive_barrier_gpu1((unsigned int*)(bar)); }
template <typename P> TILESCALE_DEVICE void wait_barrier_gpu1(P* bar) { wait_barrier_gpu1((unsigned int*)(bar)); }
template <typename P> TILESCALE_DEVICE void sync_barrier_gpu1(P* bar) { sync_barrier_gpu1((unsigned int*)(bar)); }

}  // namespace tilescale
