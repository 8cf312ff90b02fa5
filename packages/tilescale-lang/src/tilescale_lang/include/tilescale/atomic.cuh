// TileScale device runtime: atomic adds on a peer's memory at system scope -- the remote
// forms of TileLang's scalar T.atomic_add and of T.atomic_addx2 (float16/bfloat16 pairs).
// One PTX `atom{.sem}.sys.add.<type>` per call on the remapped address.
#pragma once
#include "common.cuh"

namespace tilescale {

/// PTX type of an atomic add (chosen by the Python side from the destination's dtype).
enum class AType : int { S32 = 0, U32 = 1, U64 = 2, F32 = 3, F64 = 4, F16 = 5, BF16 = 6, F16X2 = 7, BF16X2 = 8 };

template <typename U, typename T> TILESCALE_DEVICE U raw_bits(const T& v) {
  static_assert(sizeof(U) == sizeof(T), "raw_bits size mismatch");
  return *reinterpret_cast<const U*>(&v);
}
template <typename T, typename U> TILESCALE_DEVICE T from_bits(U u) {
  static_assert(sizeof(U) == sizeof(T), "from_bits size mismatch");
  return *reinterpret_cast<const T*>(&u);
}

#define TILESCALE_ATOM_SEM(M, MACRO)                                                       \
  if constexpr (M == Sem::RELAXED) { MACRO("atom.relaxed.sys") }                           \
  else if constexpr (M == Sem::ACQUIRE) { MACRO("atom.acquire.sys") }                      \
  else if constexpr (M == Sem::RELEASE) { MACRO("atom.release.sys") }                      \
  else { static_assert(M == Sem::ACQ_REL, "atomic_add semantics: relaxed, acquire, release, acq_rel"); \
         MACRO("atom.acq_rel.sys") }

/// *ptr += value on rank pe (-1: local) at system scope with semantic M; returns the old value.
template <Sem M, AType K, typename T>
TILESCALE_DEVICE value_t<T> atomic_add_sys(T* ptr, value_t<T> value, int pe) {
  void* p = const_cast<void*>(static_cast<const volatile void*>(remap(ptr, pe)));
  if constexpr (K == AType::S32 || K == AType::U32) {
    static_assert(sizeof(T) == 4, "32-bit integer atomic_add");
    unsigned int old, v = raw_bits<unsigned int>(value);
#define TILESCALE_A(PFX) asm volatile(PFX ".add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    TILESCALE_ATOM_SEM(M, TILESCALE_A)
#undef TILESCALE_A
    return from_bits<value_t<T>>(old);
  } else if constexpr (K == AType::U64) {
    static_assert(sizeof(T) == 8, "64-bit integer atomic_add");
    unsigned long long old, v = raw_bits<unsigned long long>(value);
#define TILESCALE_A(PFX) asm volatile(PFX ".add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    TILESCALE_ATOM_SEM(M, TILESCALE_A)
#undef TILESCALE_A
    return from_bits<value_t<T>>(old);
  } else if constexpr (K == AType::F32) {
    static_assert(sizeof(T) == 4, "float32 atomic_add");
    float old, v = raw_bits<float>(value);
#define TILESCALE_A(PFX) asm volatile(PFX ".add.f32 %0, [%1], %2;" : "=f"(old) : "l"(p), "f"(v) : "memory");
    TILESCALE_ATOM_SEM(M, TILESCALE_A)
#undef TILESCALE_A
    return from_bits<value_t<T>>(old);
  } else if constexpr (K == AType::F64) {
    static_assert(sizeof(T) == 8, "float64 atomic_add");
    double old, v = raw_bits<double>(value);
#define TILESCALE_A(PFX) asm volatile(PFX ".add.f64 %0, [%1], %2;" : "=d"(old) : "l"(p), "d"(v) : "memory");
    TILESCALE_ATOM_SEM(M, TILESCALE_A)
#undef TILESCALE_A
    return from_bits<value_t<T>>(old);
  } else {
    static_assert(K == AType::F16 || K == AType::BF16, "16-bit float atomic_add");
    static_assert(sizeof(T) == 2, "16-bit float atomic_add");
    unsigned short old, v = raw_bits<unsigned short>(value);
    if constexpr (K == AType::F16) {
#define TILESCALE_A(PFX) asm volatile(PFX ".add.noftz.f16 %0, [%1], %2;" : "=h"(old) : "l"(p), "h"(v) : "memory");
      TILESCALE_ATOM_SEM(M, TILESCALE_A)
#undef TILESCALE_A
    } else {
#define TILESCALE_A(PFX) asm volatile(PFX ".add.noftz.bf16 %0, [%1], %2;" : "=h"(old) : "l"(p), "h"(v) : "memory");
      TILESCALE_ATOM_SEM(M, TILESCALE_A)
#undef TILESCALE_A
    }
    return from_bits<value_t<T>>(old);
  }
}

/// dst[0:2] += src[0:2] as one packed float16x2 / bfloat16x2 atomic on rank pe, system
/// scope, semantic M.  dst must be 4-byte aligned (an even element index of an aligned
/// buffer); src is any readable pair.  Returns the old pair as 32 raw bits.
template <Sem M, AType K, typename T, typename U>
TILESCALE_DEVICE unsigned int atomic_addx2_sys(T* dst, const U* src, int pe) {
  static_assert(sizeof(T) == 2 && sizeof(U) == 2, "atomic_addx2 works on float16 / bfloat16 pairs");
  static_assert(K == AType::F16X2 || K == AType::BF16X2, "atomic_addx2 type");
  void* p = const_cast<void*>(static_cast<const volatile void*>(remap(dst, pe)));
  const unsigned int v = static_cast<unsigned int>(raw_bits<unsigned short>(src[0])) |
                         (static_cast<unsigned int>(raw_bits<unsigned short>(src[1])) << 16);
  unsigned int old;
  if constexpr (K == AType::F16X2) {
#define TILESCALE_A(PFX) asm volatile(PFX ".add.noftz.f16x2 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    TILESCALE_ATOM_SEM(M, TILESCALE_A)
#undef TILESCALE_A
  } else {
#define TILESCALE_A(PFX) asm volatile(PFX ".add.noftz.bf16x2 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    TILESCALE_ATOM_SEM(M, TILESCALE_A)
#undef TILESCALE_A
  }
  return old;
}

}  // namespace tilescale
