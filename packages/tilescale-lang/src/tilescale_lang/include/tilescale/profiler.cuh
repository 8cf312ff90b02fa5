// TileScale device runtime: intra-kernel event profiler (T.profile_event).
//
// Buffer layout (uint64, one row of 1 + 2 * CAP words per block, zeroed before the launch):
//   row[0]              events recorded by this block so far (may exceed CAP: the rest dropped)
//   row[1 + 2 * k]      event k: task (bits 0-31) | is_start (bit 32) | warp (bits 33-42)
//                       | SM id (bits 43-52) | 1 (bit 63, "written")
//   row[2 + 2 * k]      event k: %globaltimer in nanoseconds
// The host side is tilescale_lang.profiler.EventProfiler.
#pragma once
#include "common.cuh"

namespace tilescale {

/// This thread's SM id.
TILESCALE_DEVICE unsigned int sm_id() {
  unsigned int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

/// Record one event in this block's row of `buf` (CAP events per block). Called by one
/// thread per event (for example thread 0, or one lane per warp); several threads of a
/// block may record concurrently (the slot comes from an atomic counter).
template <int CAP, typename P>
TILESCALE_DEVICE void profile_event(P* buf, unsigned int task, bool is_start) {
  static_assert(CAP >= 1, "profiler capacity must be >= 1");
  static_assert(sizeof(P) == 8, "the profiler buffer is 64-bit");
  unsigned long long* row = reinterpret_cast<unsigned long long*>(buf) +
                            static_cast<unsigned long long>(block_rank()) * (1ull + 2ull * CAP);
  const unsigned long long now = global_timer_ns();
  unsigned long long slot;
  asm volatile("atom.global.add.u64 %0, [%1], 1;" : "=l"(slot) : "l"(row) : "memory");
  if (slot < static_cast<unsigned long long>(CAP)) {
    const unsigned long long warp = (thread_rank() >> 5) & 0x3FFull;
    const unsigned long long tag = static_cast<unsigned long long>(task) |
                                   (static_cast<unsigned long long>(is_start) << 32) | (warp << 33) |
                                   ((static_cast<unsigned long long>(sm_id()) & 0x3FFull) << 43) |
                                   (1ull << 63);
    row[2 + 2 * slot] = now;
    row[1 + 2 * slot] = tag;
  }
}

}  // namespace tilescale
