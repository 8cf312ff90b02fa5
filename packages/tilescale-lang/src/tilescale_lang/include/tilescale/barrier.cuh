// TileScale device runtime: grid barriers (blocks of one GPU) and cross-rank block barriers.
// All helpers here are block-collective: every thread of the block calls them.
#pragma once
#include "common.cuh"
#include "memory.cuh"
#include "wait.cuh"

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

/// Wait until the generation this block arrived in completes (acquire, gpu scope).
TILESCALE_DEVICE void wait_barrier_gpu(unsigned int* bar) {
  if (thread_rank() == 0) {
    const unsigned int token = gpu_barrier_token();
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
// Cross-rank block barrier.  `bar` is a symmetric buffer of num_ranks uint32 counters,
// zeroed once.  On rank i, bar[j] counts the block arrivals of rank j (monotonic, wrapping
// arithmetic).  Every block of every rank arrives by adding 1 to bar[me] on every rank;
// the ticket it draws from its own copy tells it its generation g, and it leaves once every
// bar[j] has reached (g + 1) * gridDim.  All ranks must launch the same number of blocks
// and all blocks must be co-resident.  With FENCE, arrivals are releases and the final
// polls acquires at system scope; without, relaxed/volatile (a bare rendezvous).
// ---------------------------------------------------------------------------------------
template <bool FENCE> TILESCALE_DEVICE void barrier_blocks(unsigned int* bar) {
  __shared__ unsigned int ticket;
  const int me = get_rank();
  const int n = get_num_ranks();
  const unsigned int tid = thread_rank();
  const unsigned int nblocks = grid_size();
  if (FENCE) fence_sys();
  __syncthreads();
  if (tid == 0) {
    // Own copy first: the ticket orders this block among this rank's arrivals.
    if (FENCE) ticket = atom_add<Scope::SYS, Sem::RELEASE>(bar + me, 1u);
    else ticket = atom_add<Scope::SYS, Sem::RELAXED>(bar + me, 1u);
  }
  for (int j = static_cast<int>(tid); j < n; j += static_cast<int>(block_size())) {
    if (j == me) continue;
    if (FENCE) atom_add<Scope::SYS, Sem::RELEASE>(remap(bar + me, j), 1u);
    else atom_add<Scope::SYS, Sem::RELAXED>(remap(bar + me, j), 1u);
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
  value_t<T>* p = (value_t<T>*)(remap(ptr, pe));
  if constexpr (ADD) {
    static_assert(sizeof(T) == 4, "notify with sig_op='add' needs a 32-bit flag");
    atom_add<Scope::SYS, Sem::RELEASE>(reinterpret_cast<unsigned int*>(p), bit_cast<unsigned int>(signal));
  } else {
    st<Scope::SYS, Sem::RELEASE, false, value_t<T>>(p, signal);
  }
}

}  // namespace tilescale
