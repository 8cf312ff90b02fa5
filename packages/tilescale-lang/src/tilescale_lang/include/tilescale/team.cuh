// TileScale device runtime: teams (strided subsets of the ranks) and team collectives.
//
// A team is an int32 symmetric (allocator) buffer made on the host by
// tilescale_lang.team.create_team and passed to the kernel as an argument:
//   team[0] start, team[1] stride, team[2] size: the members are start + i * stride
//   team[3] TEAM_MAGIC (tells a real team from zeroed memory)
//   team[4 + i] uint32 arrival counter of member i for the team barrier (zeroed at creation)
// Team barriers and collectives are called by ONE block on every member (like NVSHMEM's
// *_block operations), all threads of that block taking part; a rank that is not a member
// returns at once.
#pragma once
#include "common.cuh"
#include "memory.cuh"
#include "copy.cuh"
#include "barrier.cuh"

namespace tilescale {

#define TILESCALE_TEAM_HEADER 4
#define TILESCALE_TEAM_MAGIC 0x7e47ea11

/// First member (global rank) of the team.
template <typename P> TILESCALE_DEVICE int team_start(const P* team) { return static_cast<int>(team[0]); }
/// Distance between consecutive members.
template <typename P> TILESCALE_DEVICE int team_stride(const P* team) { return static_cast<int>(team[1]); }
/// Number of members.
template <typename P> TILESCALE_DEVICE int team_num_ranks(const P* team) { return static_cast<int>(team[2]); }

/// This rank's index in the team, or -1 when it is not a member.
template <typename P> TILESCALE_DEVICE int team_rank(const P* team) {
  const int d = get_rank() - team_start(team);
  const int stride = team_stride(team);
  if (d < 0 || stride <= 0 || d % stride != 0) return -1;
  const int r = d / stride;
  return r < team_num_ranks(team) ? r : -1;
}

/// Global rank (PE) of team member `r`, or -1 when r is not in [0, size).
template <typename P> TILESCALE_DEVICE int team_translate_pe(const P* team, int r) {
  return (r >= 0 && r < team_num_ranks(team)) ? team_start(team) + r * team_stride(team) : -1;
}

/// Barrier of one block on every member of the team (system-scope release before, acquire
/// after).  Non-members return at once.
template <typename P> TILESCALE_DEVICE void barrier_team(P* team) {
  static_assert(sizeof(P) == 4, "team storage is 32-bit");
  const int me = team_rank(team);
  if (me < 0) return;
  unsigned int* counters = reinterpret_cast<unsigned int*>(const_cast<value_t<P>*>(team)) + TILESCALE_TEAM_HEADER;
  barrier_members<true>(counters, me, team_num_ranks(team), team_start(team), team_stride(team), 1u);
}

/// Broadcast: `bytes` bytes of `src` on team member `root` are copied to `dst` on every
/// member (root included).  One block per member; it pulls from the root between two team
/// barriers, so root's src may be reused and every dst holds the data on return.
template <typename P>
TILESCALE_DEVICE void broadcast_block(P* team, void* dst, const void* src, unsigned long long bytes, int root) {
  if (team_rank(team) < 0) return;
  barrier_team(team);
  const int pe = team_translate_pe(team, root);
  if (pe >= 0) copy_block<4, false>(dst, remap(src, pe), bytes);
  barrier_team(team);
}

/// Fixed-size collect (all-gather): member i's `bytes` bytes of `src` land at
/// dst + i * bytes on every member.  One block per member, pulling between two barriers.
template <typename P>
TILESCALE_DEVICE void fcollect_block(P* team, void* dst, const void* src, unsigned long long bytes) {
  if (team_rank(team) < 0) return;
  barrier_team(team);
  const int n = team_num_ranks(team);
  char* d = static_cast<char*>(dst);
  for (int i = 0; i < n; ++i) {
    copy_block<4, false>(d + static_cast<unsigned long long>(i) * bytes, remap(src, team_translate_pe(team, i)), bytes);
  }
  barrier_team(team);
}

}  // namespace tilescale
