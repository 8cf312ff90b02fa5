// TileScale device runtime: grid barriers (blocks of one GPU) and cross-rank block barriers.
// All helpers here are block-collective: every thread of the block calls them.
#pragma once
#include "common.cuh"
#include "memory.cuh"
#include "wait.cuh"
#include "signal.cuh"

namespace tilescale {

// ---------------------------------------------------------------------------------------
// GPU barrier over the blocks of one grid.  `bar` points to two uint32 words in global
// memory, zeroed once before first use (allocator memory or torch.zeros):
//   bar[0]  arrival word: bit 31 is the phase, flipped once per completed generation
//   bar[1]  expected number of arriving blocks, written by init_barrier_gpu
// Block 0 (the linear first block) must take part in every generation: it adds
// 0x80000000 - (expected - 1) and every other block adds 1, so after `expected` arrivals the
// phase bit flips and the low bits are back where they started.  Nothing is ever reset, so
// repeated use is safe and an early arrival cannot race with init_barrier_gpu (which only
// writes bar[1]).
// ---------------------------------------------------------------------------------------

TILESCALE_DEVICE unsigned int& gpu_barrier_token() {
  __shared__ unsigned int token;
  return token;
}

/// Record the number of blocks that take part in the barrier.  Idempotent; block 0 must
/// have called it before its first arrival (calling it from every block is fine).
TILESCALE_DEVICE void init_barrier_gpu(unsigned int* bar, unsigned int expected) {
  if (thread_rank() == 0) st<Scope::GPU, Sem::RELAXED, false>(bar + 1, expected);
  __syncthreads();
}

/// Arrive at the barrier (release, gpu scope); the phase seen is kept for wait_barrier_gpu.
TILESCALE_DEVICE void arrive_barrier_gpu(unsigned int* bar) {
  __syncthreads();
  if (thread_rank() == 0) {
    unsigned int nb = 1;
    if (block_rank() == 0) {
      unsigned int expected = ld<Scope::GPU, Sem::RELAXED, false, false>(bar + 1);
      nb = 0x80000000u - (expected - 1u);
    }
    gpu_barrier_token() = atom_add<Scope::GPU, Sem::RELEASE>(bar, nb);
  }
}

/// Thread 0 polls *bar (acquire, gpu scope) until its bit 31 differs from `token`'s (the
/// generation the block arrived in completed); then the block synchronises.  Shared by the
/// two-word and the one-word layouts.
TILESCALE_DEVICE void wait_phase_flip(unsigned int* bar, unsigned int token) {
  if (thread_rank() == 0) {
    TILESCALE_WAIT_PROLOGUE
#pragma unroll 1
    while (true) {
      unsigned int cur = ld<Scope::GPU, Sem::ACQUIRE, false, false>(bar);
      if (((cur ^ token) & 0x80000000u) != 0u) break;
      TILESCALE_WAIT_CHECK("wait_barrier_gpu", bar, token ^ 0x80000000u, cur)
    }
  }
  __syncthreads();
}

/// Wait until the generation this block arrived in completes (acquire, gpu scope).
TILESCALE_DEVICE void wait_barrier_gpu(unsigned int* bar) {
  wait_phase_flip(bar, thread_rank() == 0 ? gpu_barrier_token() : 0u);
}

/// arrive_barrier_gpu followed by wait_barrier_gpu.
TILESCALE_DEVICE void sync_barrier_gpu(unsigned int* bar) {
  arrive_barrier_gpu(bar);
  wait_barrier_gpu(bar);
}

// Any 32-bit storage (int, or const from TileLang's read-only parameters).
template <typename P> TILESCALE_DEVICE void init_barrier_gpu(P* bar, unsigned int e) { init_barrier_gpu((unsigned int*)(bar), e); }
template <typename P> TILESCALE_DEVICE void arrive_barrier_gpu(P* bar) { arrive_barrier_gpu((unsigned int*)(bar)); }
template <typename P> TILESCALE_DEVICE void wait_barrier_gpu(P* bar) { wait_barrier_gpu((unsigned int*)(bar)); }
template <typename P> TILESCALE_DEVICE void sync_barrier_gpu(P* bar) { sync_barrier_gpu((unsigned int*)(bar)); }

// ---------------------------------------------------------------------------------------
// Cross-rank block barrier over a group of ranks: the `n` members start, start + stride, ...
// (this rank is member `mi`).  `bar` is a symmetric buffer of n uint32 counters, zeroed
// once.  On every member, bar[j] counts the block arrivals of member j (monotonic, wrapping
// arithmetic).  Every arriving block adds 1 to bar[mi] on every member; the ticket it draws
// from its own copy tells it its generation g, and it leaves once every bar[j] has reached
// (g + 1) * nblocks, where nblocks is the number of blocks of each member that take part
// in every generation (the whole grid for barrier_blocks, one block for team operations).
// All members must use the same nblocks and all those blocks must be co-resident.  With
// FENCE, arrivals are releases and the final polls acquires at system scope; without,
// relaxed/volatile (a bare rendezvous).
// ---------------------------------------------------------------------------------------
template <bool FENCE>
TILESCALE_DEVICE void barrier_members(unsigned int* bar, int mi, int n, int start, int stride,
                                      unsigned int nblocks) {
  __shared__ unsigned int ticket;
  const unsigned int tid = thread_rank();
  if (FENCE) fence_sys();
  __syncthreads();
  if (tid == 0) {
    // Own copy first: the ticket orders this block among this member's arrivals.
    if (FENCE) ticket = atom_add<Scope::SYS, Sem::RELEASE>(bar + mi, 1u);
    else ticket = atom_add<Scope::SYS, Sem::RELAXED>(bar + mi, 1u);
  }
  for (int j = static_cast<int>(tid); j < n; j += static_cast<int>(block_size())) {
    if (j == mi) continue;
    unsigned int* peer = remap(bar + mi, start + j * stride);
    if (FENCE) atom_add<Scope::SYS, Sem::RELEASE>(peer, 1u);
    else atom_add<Scope::SYS, Sem::RELAXED>(peer, 1u);
  }
  __syncthreads();
  const unsigned int target = (ticket / nblocks + 1u) * nblocks;
  for (int j = static_cast<int>(tid); j < n; j += static_cast<int>(block_size())) {
    TILESCALE_WAIT_PROLOGUE
#pragma unroll 1
    while (true) {
      unsigned int v = FENCE ? ld<Scope::SYS, Sem::ACQUIRE, false, false>(bar + j)
                             : ld<Scope::SYS, Sem::VOLATILE, false, false>(bar + j);
      if (static_cast<int>(v - target) >= 0) break;
      TILESCALE_WAIT_CHECK("barrier_blocks", bar + j, target, v)
    }
  }
  __syncthreads();
  if (FENCE) fence_sys();
}

/// Rendezvous of all blocks of every rank (bar: num_ranks counters).
template <bool FENCE> TILESCALE_DEVICE void barrier_blocks(unsigned int* bar) {
  barrier_members<FENCE>(bar, get_rank(), get_num_ranks(), 0, 1, grid_size());
}

template <typename P> TILESCALE_DEVICE void barrier_blocks(P* bar) {
  static_assert(sizeof(P) == 4, "barrier storage is 32-bit");
  barrier_blocks<true>((unsigned int*)(bar));
}
template <typename P> TILESCALE_DEVICE void sync_blocks(P* bar) {
  static_assert(sizeof(P) == 4, "barrier storage is 32-bit");
  barrier_blocks<false>((unsigned int*)(bar));
}

// ---------------------------------------------------------------------------------------
// notify (Triton-distributed style): signal a flag on a peer with release semantics.
// ---------------------------------------------------------------------------------------
/// Set (ADD == false) or add (ADD == true) `signal` to the flag at ptr on rank pe.
template <bool ADD, typename T>
TILESCALE_DEVICE void notify(T* ptr, int pe, value_t<T> signal) {
  signal_op<ADD>(ptr, signal, pe);
}

}  // namespace tilescale
