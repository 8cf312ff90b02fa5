// TileScale device runtime: intra-kernel event profiler (T.profile_event).
//
// Buffer layout (uint64, one row of 1 + 2 * CAP words per block, zeroed before the launch):
//   row[0]              events recorded by this block so far through the atomic counter (may
//                       exceed CAP: the rest dropped); events with a caller-chosen slot
//                       (profile_event_at) leave it alone
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

/// This block's row of a profiler buffer of CAP events per block.
template <int CAP, typename P> TILESCALE_DEVICE unsigned long long* profile_row(P* buf) {
  static_assert(CAP >= 1, "profiler capacity must be >= 1");
  static_assert(sizeof(P) == 8, "the profiler buffer is 64-bit");
  return reinterpret_cast<unsigned long long*>(buf) +
         static_cast<unsigned long long>(block_rank()) * (1ull + 2ull * CAP);
}

/// Store event `slot` (< CAP, else nothing) of `row`: its tag, then its time `now`.
template <int CAP>
TILESCALE_DEVICE void profile_store(unsigned long long* row, unsigned long long slot, unsigned int task,
                                    bool is_start, unsigned long long now) {
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

/// Record one event in this block's row of `buf` (CAP events per block). Called by one
/// thread per event (for example thread 0, or one lane per warp); several threads of a
/// block may record concurrently (the slot comes from an atomic counter, whose returned
/// value the calling thread waits for: one memory round trip per event).
template <int CAP, typename P>
TILESCALE_DEVICE void profile_event(P* buf, unsigned int task, bool is_start) {
  unsigned long long* row = profile_row<CAP>(buf);
  const unsigned long long now = global_timer_ns();
  unsigned long long slot;
  asm volatile("atom.global.add.u64 %0, [%1], 1;" : "=l"(slot) : "l"(row) : "memory");
  profile_store<CAP>(row, slot, task, is_start, now);
}

/// Record one event in slot `slot` of this block's row, chosen by the caller (no atomic,
/// no wait: two stores). The row's counter is left alone; a slot at or past CAP records
/// nothing. Every event of a block must get its own slot.
template <int CAP, typename P>
TILESCALE_DEVICE void profile_event_at(P* buf, unsigned int slot, unsigned int task, bool is_start) {
  profile_store<CAP>(profile_row<CAP>(buf), slot, task, is_start, global_timer_ns());
}

}  // namespace tilescale
