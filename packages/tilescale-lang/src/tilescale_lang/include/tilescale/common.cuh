// TileScale device runtime: configuration, the per-module metadata table, rank queries and
// symmetric-address remapping.  Self-contained (no standard headers) so that it compiles
// under nvcc and NVRTC alike.
#pragma once

#ifndef TILESCALE_WAIT_TIMEOUT_MS
// Opt-in wait timeout in milliseconds; 0 (the default) compiles the timeout code out.
#define TILESCALE_WAIT_TIMEOUT_MS 0
#endif

#ifndef TILESCALE_CHECK_PE
// Opt-in run-time PE range check (TILESCALE_CHECK_PE=1 at compile time); 0 compiles it out.
#define TILESCALE_CHECK_PE 0
#endif

#if !defined(__CUDACC_RTC__)
#include <cstdio>  // device printf for the traps below (NVRTC declares it itself)
#endif

#ifndef TILESCALE_ABI
// Hash of the TileScale headers; the Python side passes -DTILESCALE_ABI=<sha> so that the
// kernel cache key changes whenever these headers change.
#define TILESCALE_ABI unknown
#endif

#define TILESCALE_DEVICE __device__ __forceinline__
#define TILESCALE_MAX_TABLE 1024

// One metadata table per compiled module: [local_rank, num_ranks, base_0, ..., base_{n-1}].
// Filled from the host by kernel.initialize(allocator=...).  A definition (brace form), one
// symbol per module, kept by whole-program nvcc even when unused.
extern "C" {
__constant__ unsigned long long meta_data[TILESCALE_MAX_TABLE];
}

namespace tilescale {

enum class Scope : int { CTA = 0, GPU = 1, SYS = 2 };
enum class Sem : int { WEAK = 0, VOLATILE = 1, RELAXED = 2, ACQUIRE = 3, RELEASE = 4, ACQ_REL = 5 };
enum class Cmp : int { EQ = 0, NE = 1, GE = 2, LE = 3, GT = 4, LT = 5 };

template <typename T> struct dependent_false { static constexpr bool value = false; };
/// Non-deduced context: value arguments take the pointer's element type.
template <typename T> struct identity { typedef T type; };
template <typename T> struct remove_const { typedef T type; };
template <typename T> struct remove_const<const T> { typedef T type; };
/// Value type for a pointer to T: T without const (TileLang marks read-only params const).
template <typename T> using value_t = typename remove_const<T>::type;

template <typename To, typename From> TILESCALE_DEVICE To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "tilescale::bit_cast size mismatch");
  union { From f; To t; } u;
  u.f = v;
  return u.t;
}

/// Trap: the module's table was never filled (kernel.initialize was not called), so every
/// peer address would silently be the local one.
static __device__ __noinline__ void missing_table_trap() {
  printf("[tilescale] kernel launched without kernel.initialize(allocator=...): its metadata "
         "table is empty (num_ranks == 0), so peer addresses are unknown; block (%d,%d,%d) "
         "thread (%d,%d,%d)\n",
         (int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, (int)threadIdx.x, (int)threadIdx.y,
         (int)threadIdx.z);
  __trap();
}

/// Every read of the table goes through here: an initialised table has num_ranks >= 1
/// (one uniform constant-cache load and a never-taken branch).
TILESCALE_DEVICE void require_table() {
  if (meta_data[1] == 0ull) missing_table_trap();
}

/// Rank of this process in the allocator's group (meta_data[0]).
TILESCALE_DEVICE int get_rank() { require_table(); return static_cast<int>(meta_data[0]); }
/// Number of ranks in the allocator's group (meta_data[1]).
TILESCALE_DEVICE int get_num_ranks() { require_table(); return static_cast<int>(meta_data[1]); }
/// Base address of rank `pe`'s symmetric heap, mapped into this process.
TILESCALE_DEVICE unsigned long long peer_base(int pe) { require_table(); return meta_data[2 + pe]; }

#if TILESCALE_CHECK_PE
/// Trap: a run-time PE outside 0..num_ranks-1 (compiled in with TILESCALE_CHECK_PE=1).
static __device__ __noinline__ void pe_out_of_range_trap(int pe) {
  printf("[tilescale] PE %d out of range: rank %d of %d ranks, block (%d,%d,%d) thread (%d,%d,%d)\n",
         pe, (int)meta_data[0], (int)meta_data[1], (int)blockIdx.x, (int)blockIdx.y,
         (int)blockIdx.z, (int)threadIdx.x, (int)threadIdx.y, (int)threadIdx.z);
  __trap();
}
#endif

/// Address of `ptr`'s symmetric counterpart on rank `pe`.  Only -1 keeps the local address
/// (so a PE that is -1 only at run time is local too); any other PE outside
/// 0..num_ranks-1, negative ones included, traps with TILESCALE_CHECK_PE=1.
template <typename T> TILESCALE_DEVICE T* remap(T* ptr, int pe) {
  if (pe == -1) return ptr;
  const int me = get_rank();
#if TILESCALE_CHECK_PE
  if (static_cast<unsigned int>(pe) >= static_cast<unsigned int>(meta_data[1])) pe_out_of_range_trap(pe);
#endif
  unsigned long long p = reinterpret_cast<unsigned long long>(ptr);
  return reinterpret_cast<T*>(p - meta_data[2 + me] + meta_data[2 + pe]);
}

/// remap() as an untyped, non-const pointer (for DeclBuffer views of remote buffers).
template <typename T> TILESCALE_DEVICE void* remap_ptr(T* ptr, int pe) {
  return const_cast<void*>(static_cast<const volatile void*>(remap(ptr, pe)));
}

/// Linear thread index within the block.
TILESCALE_DEVICE unsigned int thread_rank() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
/// Number of threads in the block.
TILESCALE_DEVICE unsigned int block_size() { return blockDim.x * blockDim.y * blockDim.z; }
/// Linear block index within the grid.
TILESCALE_DEVICE unsigned int block_rank() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
/// Number of blocks in the grid.
TILESCALE_DEVICE unsigned int grid_size() { return gridDim.x * gridDim.y * gridDim.z; }

/// Nanosecond global timer.
TILESCALE_DEVICE unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace tilescale
