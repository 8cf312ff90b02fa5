// TileScale device runtime: scoped loads, stores, atomics and fences through inline PTX.
// Addresses are generic (any state space) except for the non-coherent ld.global.nc path.
#pragma once
#include "common.cuh"

namespace tilescale {

// Emit one load of T (4 or 8 bytes) with the instruction prefix PFX.
#define TILESCALE_LD_ASM(PFX)                                                              \
  if constexpr (sizeof(T) == 4) {                                                          \
    unsigned int r;                                                                        \
    asm volatile(PFX ".b32 %0, [%1];" : "=r"(r) : "l"(ptr) : "memory");                    \
    return bit_cast<value_t<T>>(r);                                                                 \
  } else {                                                                                 \
    unsigned long long r;                                                                  \
    asm volatile(PFX ".b64 %0, [%1];" : "=l"(r) : "l"(ptr) : "memory");                    \
    return bit_cast<value_t<T>>(r);                                                                 \
  }

#define TILESCALE_ST_ASM(PFX)                                                              \
  if constexpr (sizeof(T) == 4) {                                                          \
    asm volatile(PFX ".b32 [%0], %1;" ::"l"(ptr), "r"(bit_cast<unsigned int>(value))        \
                 : "memory");                                                              \
  } else {                                                                                 \
    asm volatile(PFX ".b64 [%0], %1;" ::"l"(ptr), "l"(bit_cast<unsigned long long>(value))  \
                 : "memory");                                                              \
  }

#define TILESCALE_SCOPED(MACRO, SEMSTR, SUFFIX)                                            \
  if constexpr (S == Scope::CTA) { MACRO(SEMSTR ".cta" SUFFIX) }                           \
  else if constexpr (S == Scope::GPU) { MACRO(SEMSTR ".gpu" SUFFIX) }                      \
  else { MACRO(SEMSTR ".sys" SUFFIX) }

/// Load *ptr with scope S and semantic M (WEAK, VOLATILE, RELAXED, ACQUIRE).  NA adds
/// .L1::no_allocate; NC uses the non-coherent ld.global.nc path (WEAK only; ptr must be
/// global memory that no one writes while the kernel runs).
template <Scope S, Sem M, bool NA, bool NC, typename T> TILESCALE_DEVICE value_t<T> ld(const T* ptr) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "tilescale::ld supports 32- and 64-bit values");
  static_assert(!NC || M == Sem::WEAK, "nc loads have no memory-model semantic");
  static_assert(!(NA && M == Sem::VOLATILE), "ld.volatile has no eviction-priority form");
  if constexpr (NC) {
    if constexpr (NA) { TILESCALE_LD_ASM("ld.global.nc.L1::no_allocate") }
    else { TILESCALE_LD_ASM("ld.global.nc") }
  } else if constexpr (M == Sem::WEAK) {
    if constexpr (NA) { TILESCALE_LD_ASM("ld.L1::no_allocate") }
    else { TILESCALE_LD_ASM("ld") }
  } else if constexpr (M == Sem::VOLATILE) {
    TILESCALE_LD_ASM("ld.volatile")
  } else if constexpr (M == Sem::RELAXED) {
    if constexpr (NA) { TILESCALE_SCOPED(TILESCALE_LD_ASM, "ld.relaxed", ".L1::no_allocate") }
    else { TILESCALE_SCOPED(TILESCALE_LD_ASM, "ld.relaxed", "") }
  } else if constexpr (M == Sem::ACQUIRE) {
    if constexpr (NA) { TILESCALE_SCOPED(TILESCALE_LD_ASM, "ld.acquire", ".L1::no_allocate") }
    else { TILESCALE_SCOPED(TILESCALE_LD_ASM, "ld.acquire", "") }
  } else {
    static_assert(dependent_false<T>::value, "ld supports weak, volatile, relaxed, acquire");
  }
}

/// ld from the symmetric counterpart of ptr on rank pe (-1: local).
template <Scope S, Sem M, bool NA, bool NC, typename T>
TILESCALE_DEVICE value_t<T> ld(const T* ptr, int pe) {
  return ld<S, M, NA, NC, T>(remap(ptr, pe));
}

/// Store value to *ptr with scope S and semantic M (WEAK, VOLATILE, RELAXED, RELEASE);
/// NA adds .L1::no_allocate.
template <Scope S, Sem M, bool NA, typename T>
TILESCALE_DEVICE void st(T* ptr, value_t<T> value) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "tilescale::st supports 32- and 64-bit values");
  static_assert(!(NA && M == Sem::VOLATILE), "st.volatile has no eviction-priority form");
  if constexpr (M == Sem::WEAK) {
    if constexpr (NA) { TILESCALE_ST_ASM("st.L1::no_allocate") }
    else { TILESCALE_ST_ASM("st") }
  } else if constexpr (M == Sem::VOLATILE) {
    TILESCALE_ST_ASM("st.volatile")
  } else if constexpr (M == Sem::RELAXED) {
    if constexpr (NA) { TILESCALE_SCOPED(TILESCALE_ST_ASM, "st.relaxed", ".L1::no_allocate") }
    else { TILESCALE_SCOPED(TILESCALE_ST_ASM, "st.relaxed", "") }
  } else if constexpr (M == Sem::RELEASE) {
    if constexpr (NA) { TILESCALE_SCOPED(TILESCALE_ST_ASM, "st.release", ".L1::no_allocate") }
    else { TILESCALE_SCOPED(TILESCALE_ST_ASM, "st.release", "") }
  } else {
    static_assert(dependent_false<T>::value, "st supports weak, volatile, relaxed, release");
  }
}

/// st to the symmetric counterpart of ptr on rank pe (-1: local).
template <Scope S, Sem M, bool NA, typename T>
TILESCALE_DEVICE void st(T* ptr, value_t<T> value, int pe) {
  st<S, M, NA, T>(remap(ptr, pe), value);
}

/// One 16-byte weak store (st.global.v4.b32) of `value` (any 16-byte type: uint4, float4,
/// a vector of 8 half_t, ...) at `dst`, a 16-byte aligned global address (local or a peer's).
/// Remote vectorised stores of T.copy are lowered to it (tilescale_lang.remote_stores): nvcc
/// splits the plain 16-byte assignment through a remapped pointer into four 4-byte stores.
template <typename P, typename V> TILESCALE_DEVICE void store_vec16(P* dst, const V& value) {
  static_assert(sizeof(V) == 16, "tilescale::store_vec16 stores exactly 16 bytes");
  const uint4 v = bit_cast<uint4>(value);
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};"
               :
               : "l"(const_cast<void*>(static_cast<const volatile void*>(dst))), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
               : "memory");
}

/// One 16-byte volatile load (ld.volatile.global.v4.b32) from `src`, a 16-byte aligned global
/// address (local or a peer's): every call reads memory, as a spin on data needs.
TILESCALE_DEVICE uint4 ld_volatile_vec16(const void* src) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(src)
               : "memory");
  return v;
}

/// One 16-byte volatile store (st.volatile.global.v4.b32) of `v` at `dst`, a 16-byte aligned
/// global address (local or a peer's).
TILESCALE_DEVICE void st_volatile_vec16(void* dst, uint4 v) {
  asm volatile("st.volatile.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

#define TILESCALE_ATOM_ASM(PFX)                                                            \
  asm volatile(PFX ".add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");

/// Atomic add on a uint32 with scope S (GPU, SYS) and semantic M (RELAXED, ACQUIRE, RELEASE,
/// ACQ_REL); returns the previous value.
template <Scope S, Sem M> TILESCALE_DEVICE unsigned int atom_add(unsigned int* ptr, unsigned int value) {
  unsigned int old;
  static_assert(S == Scope::GPU || S == Scope::SYS || S == Scope::CTA, "bad atom scope");
  if constexpr (M == Sem::RELAXED) { TILESCALE_SCOPED(TILESCALE_ATOM_ASM, "atom.relaxed", "") }
  else if constexpr (M == Sem::ACQUIRE) { TILESCALE_SCOPED(TILESCALE_ATOM_ASM, "atom.acquire", "") }
  else if constexpr (M == Sem::RELEASE) { TILESCALE_SCOPED(TILESCALE_ATOM_ASM, "atom.release", "") }
  else if constexpr (M == Sem::ACQ_REL) { TILESCALE_SCOPED(TILESCALE_ATOM_ASM, "atom.acq_rel", "") }
  else { static_assert(M == Sem::RELAXED, "atom_add supports relaxed, acquire, release, acq_rel"); }
  return old;
}

/// Atomic add through any 32-bit pointer (int, const from TileLang's read-only params).
template <Scope S, Sem M, typename P> TILESCALE_DEVICE unsigned int atom_add(P* ptr, unsigned int value) {
  static_assert(sizeof(P) == 4, "atom_add needs a 32-bit target");
  return atom_add<S, M>((unsigned int*)(ptr), value);
}

/// Atomic add on the symmetric counterpart of ptr on rank pe (-1: local).
template <Scope S, Sem M, typename P>
TILESCALE_DEVICE unsigned int atom_add(P* ptr, unsigned int value, int pe) {
  return atom_add<S, M>((unsigned int*)(remap(ptr, pe)), value);
}

/// Memory fences (fence.acq_rel.{cta,gpu,sys}).
TILESCALE_DEVICE void fence_cta() { asm volatile("fence.acq_rel.cta;" ::: "memory"); }
TILESCALE_DEVICE void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
TILESCALE_DEVICE void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

template <Scope S> TILESCALE_DEVICE void fence() {
  if constexpr (S == Scope::CTA) fence_cta();
  else if constexpr (S == Scope::GPU) fence_gpu();
  else fence_sys();
}

}  // namespace tilescale
