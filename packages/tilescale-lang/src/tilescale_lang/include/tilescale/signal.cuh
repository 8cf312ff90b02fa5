// TileScale device runtime: signals (put-with-signal, signal_op), compare-and-swap, and the
// completion/ordering operations quiet() and fence(), after NVSHMEM's device API.
//
// Memory-model contract (PTX ISA, "Memory Consistency Model"):
//  * signal_update is a release operation at system scope (st.release.sys / atom.release.sys
//    .add): every memory operation that precedes it in causality order -- this thread's
//    earlier accesses and, after a bar.sync, those of the other threads of the block -- is
//    visible to a thread that observes the new signal value with an acquire operation
//    (T.signal_wait_until / T.wait_* / ld.acquire.sys).
//  * put_signal: the block (or warp) copies the data with weak stores, synchronises
//    (bar.sync / bar.warp.sync: morally strong at CTA scope) and one thread then releases
//    the signal, so the data is in causality order before the signal: a consumer that
//    acquires the signal reads the data, never stale values.
//  * quiet(): fence.sc.sys -- every memory access of the calling thread before it is
//    performed, at system scope, before any access after it (fence.sc also orders it in
//    the single total order of fence.sc operations).
//  * fence(): fence.acq_rel.sys -- orders the calling thread's accesses before it against
//    those after it for any observer that synchronises at system scope.
#pragma once
#include "common.cuh"
#include "memory.cuh"
#include "copy.cuh"

namespace tilescale {

/// The unsigned integer of N bytes (4 or 8): the word a compare-and-swap operates on.
template <int N> struct word_of { typedef unsigned int type; };
template <> struct word_of<8> { typedef unsigned long long type; };

/// fence.sc.sys: completes (orders at system scope) every outstanding access of this thread.
TILESCALE_DEVICE void quiet() { asm volatile("fence.sc.sys;" ::: "memory"); }
/// fence.acq_rel.sys: orders this thread's accesses before it against those after it.
TILESCALE_DEVICE void fence() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

/// Release-update the 32/64-bit signal at `sig` (already remapped): set (ADD == false) or
/// atomic add (ADD == true), system scope.
template <bool ADD, typename T> TILESCALE_DEVICE void signal_update(T* sig, value_t<T> value) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "signals are 32- or 64-bit");
  if constexpr (ADD) {
    if constexpr (sizeof(T) == 4) {
      asm volatile("red.release.sys.add.u32 [%0], %1;" ::"l"(sig), "r"(bit_cast<unsigned int>(value))
                   : "memory");
    } else {
      asm volatile("red.release.sys.add.u64 [%0], %1;" ::"l"(sig), "l"(bit_cast<unsigned long long>(value))
                   : "memory");
    }
  } else {
    st<Scope::SYS, Sem::RELEASE, false, value_t<T>>(const_cast<value_t<T>*>(sig), value);
  }
}

/// signal_op: update the signal at `sig` on rank `pe` (-1: local) with release semantics.
template <bool ADD, typename T> TILESCALE_DEVICE void signal_op(T* sig, value_t<T> value, int pe) {
  signal_update<ADD>(const_cast<value_t<T>*>(remap(sig, pe)), value);
}

/// Put `bytes` bytes from local `src` to `dst` on rank `pe`, then update the signal at `sig`
/// on `pe` once the data is visible there.  WARP: the 32 lanes of the calling warp take
/// part (lane 0 signals); otherwise every thread of the block (thread 0 signals).  Blocking
/// (NBI == false): every participating thread returns after the signal was issued, so the
/// whole source may be reused; non-blocking: threads other than the signalling one may
/// return before it (the ordering data -> signal is the same).
template <int UNROLL, bool WARP, bool NBI, bool ADD, typename S>
TILESCALE_DEVICE void put_signal(const void* src, void* dst, unsigned long long bytes, S* sig,
                                 value_t<S> signal, int pe) {
  void* d = remap(dst, pe);
  if constexpr (WARP) {
    copy_warp<UNROLL, false>(d, src, bytes);
    __syncwarp();
    if ((thread_rank() & 31u) == 0u) signal_op<ADD>(sig, signal, pe);
    if constexpr (!NBI) __syncwarp();
  } else {
    copy_block<UNROLL, false>(d, src, bytes);
    __syncthreads();
    if (thread_rank() == 0u) signal_op<ADD>(sig, signal, pe);
    if constexpr (!NBI) __syncthreads();
  }
}

#define TILESCALE_CAS_ASM(PFX, REG, CT)                                                    \
  asm volatile(PFX ".cas.b" #CT " %0, [%1], %2, %3;"                                        \
               : "=" REG(old)                                                               \
               : "l"(ptr), REG(cmp), REG(val)                                              \
               : "memory");
#define TILESCALE_CAS32(PFX) TILESCALE_CAS_ASM(PFX, "r", 32)
#define TILESCALE_CAS64(PFX) TILESCALE_CAS_ASM(PFX, "l", 64)

/// Compare-and-swap on a 32/64-bit word with scope S and semantic M (RELAXED, ACQUIRE,
/// RELEASE, ACQ_REL): if *ptr == cmp, *ptr = val.  Returns the previous value.
template <Scope S, Sem M, typename W> TILESCALE_DEVICE W cas_word(W* ptr, W cmp, W val) {
  W old;
  if constexpr (sizeof(W) == 4) {
    if constexpr (M == Sem::RELAXED) { TILESCALE_SCOPED(TILESCALE_CAS32, "atom.relaxed", "") }
    else if constexpr (M == Sem::ACQUIRE) { TILESCALE_SCOPED(TILESCALE_CAS32, "atom.acquire", "") }
    else if constexpr (M == Sem::RELEASE) { TILESCALE_SCOPED(TILESCALE_CAS32, "atom.release", "") }
    else { static_assert(M == Sem::ACQ_REL, "atomic_cas semantics: relaxed, acquire, release, acq_rel");
           TILESCALE_SCOPED(TILESCALE_CAS32, "atom.acq_rel", "") }
  } else {
    if constexpr (M == Sem::RELAXED) { TILESCALE_SCOPED(TILESCALE_CAS64, "atom.relaxed", "") }
    else if constexpr (M == Sem::ACQUIRE) { TILESCALE_SCOPED(TILESCALE_CAS64, "atom.acquire", "") }
    else if constexpr (M == Sem::RELEASE) { TILESCALE_SCOPED(TILESCALE_CAS64, "atom.release", "") }
    else { static_assert(M == Sem::ACQ_REL, "atomic_cas semantics: relaxed, acquire, release, acq_rel");
           TILESCALE_SCOPED(TILESCALE_CAS64, "atom.acq_rel", "") }
  }
  return old;
}

/// atomic_cas on the symmetric counterpart of ptr on rank pe (-1: local); any 32/64-bit
/// integer type.  Returns the previous value.
template <Scope S, Sem M, typename T>
TILESCALE_DEVICE value_t<T> atomic_cas(T* ptr, value_t<T> cmp, value_t<T> val, int pe) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomic_cas supports 32- and 64-bit words");
  typedef typename word_of<sizeof(T)>::type W;
  W* p = reinterpret_cast<W*>(const_cast<value_t<T>*>(remap(ptr, pe)));
  return bit_cast<value_t<T>>(cas_word<S, M, W>(p, bit_cast<W>(cmp), bit_cast<W>(val)));
}

}  // namespace tilescale
