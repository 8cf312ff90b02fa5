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

// One `atom{.sem}.sys.add<TY>` of register `v` (constraint C) into [p], the old value in `old`.
#define TILESCALE_ATOM_ADD_SYS(C, TY)                                                          \
  if constexpr (M == Sem::RELAXED)                                                         \
    asm volatile("atom.relaxed.sys.add" TY " %0, [%1], %2;" : "=" C(old) : "l"(p), C(v) : "memory"); \
  else if constexpr (M == Sem::ACQUIRE)                                                    \
    asm volatile("atom.acquire.sys.add" TY " %0, [%1], %2;" : "=" C(old) : "l"(p), C(v) : "memory"); \
  else if constexpr (M == Sem::RELEASE)                                                    \
    asm volatile("atom.release.sys.add" TY " %0, [%1], %2;" : "=" C(old) : "l"(p), C(v) : "memory"); \
  else {                                                                                   \
    static_assert(M == Sem::ACQ_REL, "atomic_add semantics: relaxed, acquire, release, acq_rel"); \
    asm volatile("atom.acq_rel.sys.add" TY " %0, [%1], %2;" : "=" C(old) : "l"(p), C(v) : "memory"); \
  }

/// The add of AType K on the register type W at p, semantic M; returns the old bits.
template <Sem M, AType K, typename W> TILESCALE_DEVICE W atom_add_sys_bits(void* p, W v) {
  W old;
  if constexpr (K == AType::S32 || K == AType::U32) { TILESCALE_ATOM_ADD_SYS("r", ".u32") }
  else if constexpr (K == AType::U64) { TILESCALE_ATOM_ADD_SYS("l", ".u64") }
  else if constexpr (K == AType::F32) { TILESCALE_ATOM_ADD_SYS("f", ".f32") }
  else if constexpr (K == AType::F64) { TILESCALE_ATOM_ADD_SYS("d", ".f64") }
  else if constexpr (K == AType::F16) { TILESCALE_ATOM_ADD_SYS("h", ".noftz.f16") }
  else if constexpr (K == AType::BF16) { TILESCALE_ATOM_ADD_SYS("h", ".noftz.bf16") }
  else if constexpr (K == AType::F16X2) { TILESCALE_ATOM_ADD_SYS("r", ".noftz.f16x2") }
  else { static_assert(K == AType::BF16X2, "atomic add type"); TILESCALE_ATOM_ADD_SYS("r", ".noftz.bf16x2") }
  return old;
}

/// The register type of an AType.
template <AType K> struct atom_reg { typedef unsigned int type; };
template <> struct atom_reg<AType::U64> { typedef unsigned long long type; };
template <> struct atom_reg<AType::F32> { typedef float type; };
template <> struct atom_reg<AType::F64> { typedef double type; };
template <> struct atom_reg<AType::F16> { typedef unsigned short type; };
template <> struct atom_reg<AType::BF16> { typedef unsigned short type; };

/// *ptr += value on rank pe (-1: local) at system scope with semantic M; returns the old value.
template <Sem M, AType K, typename T>
TILESCALE_DEVICE value_t<T> atomic_add_sys(T* ptr, value_t<T> value, int pe) {
  typedef typename atom_reg<K>::type W;
  static_assert(sizeof(W) == sizeof(T), "atomic_add: the destination type does not match its PTX type");
  static_assert(K != AType::F16X2 && K != AType::BF16X2, "pairs go through atomic_addx2_sys");
  void* p = const_cast<void*>(static_cast<const volatile void*>(remap(ptr, pe)));
  return from_bits<value_t<T>>(atom_add_sys_bits<M, K, W>(p, raw_bits<W>(value)));
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
  return atom_add_sys_bits<M, K, unsigned int>(p, v);
}

}  // namespace tilescale
