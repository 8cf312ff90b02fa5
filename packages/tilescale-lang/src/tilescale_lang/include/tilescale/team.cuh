// TileScale device runtime: teams (strided subsets of the ranks) and team collectives.
//
// A team is an int32 symmetric (allocator) buffer made on the host by
// tilescale_lang.team.create_team and passed to the kernel as an argument:
//   team[0] start, team[1] stride, team[2] size: the members are start + i * stride
//   team[3] TEAM_MAGIC (tells a real team from zeroed memory)
//   team[4 + i] uint32 arrival counter of member i for the team barrier (zeroed at creation)
// Team barriers and collectives are called by ONE block on every member (like NVSHMEM's
// *_block operations), all threads of that block taking part; a rank that is not a member
// returns at once.  Every team operation first checks team[3] == TEAM_MAGIC and traps when
// it is not (a zeroed tensor would otherwise turn barriers and collectives into no-ops).
#pragma once
#include "common.cuh"
#include "memory.cuh"
#include "copy.cuh"
#include "barrier.cuh"

#if !defined(__CUDACC_RTC__)
#include <cstdio>  // device printf of the misuse reports (NVRTC declares it itself)
#endif

namespace tilescale {

#define TILESCALE_TEAM_HEADER 4
#define TILESCALE_TEAM_MAGIC 0x7e47ea11

/// Trap: the tensor passed as a team has no TEAM_MAGIC in team[3] (zeroed memory, or not a
/// tensor from create_team), so every team operation would silently do nothing.
static __device__ __noinline__ void bad_team_trap(const void* team, unsigned int magic) {
  printf("[tilescale] team tensor at %p is not a team (team[3] = 0x%08x, not TEAM_MAGIC 0x%08x; "
         "pass create_team(...).tensor): rank %d block (%d,%d,%d) thread (%d,%d,%d)\n",
         team, magic, (unsigned int)TILESCALE_TEAM_MAGIC, (int)meta_data[0], (int)blockIdx.x,
         (int)blockIdx.y, (int)blockIdx.z, (int)threadIdx.x, (int)threadIdx.y, (int)threadIdx.z);
  __trap();
}

/// Trap: a team collective's root is not a member index in [0, size).
static __device__ __noinline__ void bad_root_trap(int root, int size) {
  printf("[tilescale] broadcast_block: root %d is outside the team's members [0, %d): rank %d "
         "block (%d,%d,%d) thread (%d,%d,%d)\n",
         root, size, (int)meta_data[0], (int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z,
         (int)threadIdx.x, (int)threadIdx.y, (int)threadIdx.z);
  __trap();
}

/// Trap unless `team` carries TEAM_MAGIC (every public team operation checks it first).
template <typename P> TILESCALE_DEVICE void require_team(const P* team) {
  static_assert(sizeof(P) == 4, "team storage is 32-bit");
  const unsigned int magic = static_cast<unsigned int>(team[3]);
  if (magic != TILESCALE_TEAM_MAGIC) bad_team_trap(team, magic);
}

/// First member (global rank) of the team.
template <typename P> TILESCALE_DEVICE int team_start(const P* team) { return static_cast<int>(team[0]); }
/// Distance between consecutive members.
template <typename P> TILESCALE_DEVICE int team_stride(const P* team) { return static_cast<int>(team[1]); }
/// Number of members (unchecked; team_num_ranks checks the magic first).
template <typename P> TILESCALE_DEVICE int team_size(const P* team) { return static_cast<int>(team[2]); }

/// This rank's index in the team, or -1 when it is not a member (unchecked).
template <typename P> TILESCALE_DEVICE int team_rank_unchecked(const P* team) {
  const int d = get_rank() - team_start(team);
  const int stride = team_stride(team);
  if (d < 0 || stride <= 0 || d % stride != 0) return -1;
  const int r = d / stride;
  return r < team_size(team) ? r : -1;
}

/// Global rank (PE) of team member `r`, or -1 when r is not in [0, size) (unchecked).
template <typename P> TILESCALE_DEVICE int team_translate_pe_unchecked(const P* team, int r) {
  return (r >= 0 && r < team_size(team)) ? team_start(team) + r * team_stride(team) : -1;
}

/// Number of members.
template <typename P> TILESCALE_DEVICE int team_num_ranks(const P* team) {
  require_team(team);
  return team_size(team);
}

/// This rank's index in the team, or -1 when it is not a member.
template <typename P> TILESCALE_DEVICE int team_rank(const P* team) {
  require_team(team);
  return team_rank_unchecked(team);
}

/// Global rank (PE) of team member `r`, or -1 when r is not in [0, size).
template <typename P> TILESCALE_DEVICE int team_translate_pe(const P* team, int r) {
  require_team(team);
  return team_translate_pe_unchecked(team, r);
}

/// The team barrier for member `me` (>= 0) of a checked team.
template <typename P> TILESCALE_DEVICE void barrier_team_member(P* team, int me) {
  unsigned int* counters = reinterpret_cast<unsigned int*>(const_cast<value_t<P>*>(team)) + TILESCALE_TEAM_HEADER;
  barrier_members<true>(counters, me, team_size(team), team_start(team), team_stride(team), 1u);
}

/// Barrier of one block on every member of the team (system-scope release before, acquire
/// after).  Non-members return at once; a tensor that is not a team traps.
template <typename P> TILESCALE_DEVICE void barrier_team(P* team) {
  static_assert(sizeof(P) == 4, "team storage is 32-bit");
  const int me = team_rank(team);
  if (me < 0) return;
  barrier_team_member(team, me);
}

/// Broadcast: `bytes` bytes of `src` on team member `root` are copied to `dst` on every
/// member (root included).  One block per member; it pulls from the root between two team
/// barriers, so root's src may be reused and every dst holds the data on return.  A root
/// outside [0, size) traps.
template <typename P>
TILESCALE_DEVICE void broadcast_block(P* team, void* dst, const void* src, unsigned long long bytes, int root) {
  const int me = team_rank(team);
  if (me < 0) return;
  const int pe = team_translate_pe_unchecked(team, root);
  if (pe < 0) bad_root_trap(root, team_size(team));
  barrier_team_member(team, me);
  copy_block<4, false>(dst, remap(src, pe), bytes);
  barrier_team_member(team, me);
}

/// Fixed-size collect (all-gather): member i's `bytes` bytes of `src` land at
/// dst + i * bytes on every member.  One block per member, pulling between two barriers.
template <typename P>
TILESCALE_DEVICE void fcollect_block(P* team, void* dst, const void* src, unsigned long long bytes) {
  const int me = team_rank(team);
  if (me < 0) return;
  barrier_team_member(team, me);
  const int n = team_size(team);
  char* d = static_cast<char*>(dst);
  for (int i = 0; i < n; ++i) {
    copy_block<4, false>(d + static_cast<unsigned long long>(i) * bytes, remap(src, team_translate_pe_unchecked(team, i)), bytes);
  }
  barrier_team_member(team, me);
}

}  // namespace tilescale
