// TileScale device runtime: multimem (NVLink multicast) operations through inline PTX.
//
// The multicast operand of every helper is a *multimem address*: a global-memory address
// inside a multicast mapping (the allocator's multicast region).  Plain, unicast addresses
// are undefined behaviour for multimem.* (PTX ISA), so the helpers never remap them.
//
// Each helper handles one element (32/64-bit types) or one packed pair (.f16x2/.bf16x2);
// the Python side generates the loop that spreads a region over the threads.  The PTX type
// and reduction are template arguments chosen (and validated) by the Python side; the
// static_asserts below only back that up.  Requirements: sm_90+, CUDA 12.1+ (PTX 8.1);
// the .acc::f32 packed load-reduce needs CUDA 12.2+ (PTX 8.2); the bulk store
// (multimem_tma_store) needs CUDA 13.1+.  Unsupported builds fail at compile time with a
// static_assert, never with a run-time trap.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define TILESCALE_MULTIMEM_ARCH_OK 0
#else
#define TILESCALE_MULTIMEM_ARCH_OK 1
#endif

#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1))
#define TILESCALE_MULTIMEM_PTX81_OK 1
#else
#define TILESCALE_MULTIMEM_PTX81_OK 0
#endif

#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 2))
#define TILESCALE_MULTIMEM_PTX82_OK 1
#else
#define TILESCALE_MULTIMEM_PTX82_OK 0
#endif

#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 13 || (__CUDACC_VER_MAJOR__ == 13 && __CUDACC_VER_MINOR__ >= 1))
#define TILESCALE_MULTIMEM_BULK_OK 1
#else
#define TILESCALE_MULTIMEM_BULK_OK 0
#endif

namespace tilescale {

/// Reduction of a multimem operation (NONE: plain store, for multimem_tma_store).
enum class MMOp : int { NONE = 0, ADD = 1, MIN = 2, MAX = 3 };
/// PTX element type of a multimem operation.
enum class MMType : int { B32 = 0, B64 = 1, F32 = 2, F64 = 3, U32 = 4, S32 = 5, U64 = 6, S64 = 7, F16X2 = 8, BF16X2 = 9 };

template <MMType Y> struct mm_bits { static constexpr int value = (Y == MMType::B64 || Y == MMType::F64 || Y == MMType::U64 || Y == MMType::S64) ? 64 : 32; };

template <typename T> struct mm_check {
  static_assert(TILESCALE_MULTIMEM_ARCH_OK || dependent_false<T>::value,
                "tilescale multimem operations need sm_90 or newer (PTX multimem.*); compile for sm_90/sm_90a+");
  static_assert(TILESCALE_MULTIMEM_PTX81_OK || dependent_false<T>::value,
                "tilescale multimem operations need CUDA Toolkit 12.1+ (PTX ISA 8.1)");
  static constexpr bool ok = true;
};

// ---------------------------------------------------------------- one-instruction emitters
// PFX: "multimem.<inst>.<sem>.sys.global"; SFX: ".<op>{.acc::f32}.<type>".
#define TILESCALE_MM_LD32(PFX, SFX) \
  asm volatile(PFX SFX " %0, [%1];" : "=r"(r32) : "l"(ptr) : "memory");
#define TILESCALE_MM_LD64(PFX, SFX) \
  asm volatile(PFX SFX " %0, [%1];" : "=l"(r64) : "l"(ptr) : "memory");
#define TILESCALE_MM_ST32(PFX, SFX) \
  asm volatile(PFX SFX " [%0], %1;" ::"l"(ptr), "r"(v32) : "memory");
#define TILESCALE_MM_ST64(PFX, SFX) \
  asm volatile(PFX SFX " [%0], %1;" ::"l"(ptr), "l"(v64) : "memory");

// Dispatch on the (op, type) pairs PTX has; anything else is a static_assert.
#define TILESCALE_MM_INT_OPS(E32, E64, PFX, OPSTR)                                        \
  if constexpr (Y == MMType::U32) { E32(PFX, OPSTR ".u32") }                              \
  else if constexpr (Y == MMType::S32) { E32(PFX, OPSTR ".s32") }                         \
  else if constexpr (Y == MMType::U64) { E64(PFX, OPSTR ".u64") }                         \
  else if constexpr (Y == MMType::S64) { E64(PFX, OPSTR ".s64") }

/// multimem.ld_reduce.relaxed.sys.global on one 32/64-bit element or one packed pair;
/// returns the raw bits (unsigned int or unsigned long long, as `R`).
template <MMOp Op, MMType Y, typename R, typename T> TILESCALE_DEVICE R mm_ld_reduce_bits(const T* ptr) {
  static_assert(mm_check<T>::ok, "");
  unsigned int r32 = 0;
  unsigned long long r64 = 0;
#define PFX "multimem.ld_reduce.relaxed.sys.global"
  if constexpr (Op == MMOp::ADD) {
    if constexpr (Y == MMType::F32) { TILESCALE_MM_LD32(PFX, ".add.f32") }
    else if constexpr (Y == MMType::F64) { TILESCALE_MM_LD64(PFX, ".add.f64") }
    else if constexpr (Y == MMType::U32) { TILESCALE_MM_LD32(PFX, ".add.u32") }
    else if constexpr (Y == MMType::S32) { TILESCALE_MM_LD32(PFX, ".add.s32") }
    else if constexpr (Y == MMType::U64) { TILESCALE_MM_LD64(PFX, ".add.u64") }
    else if constexpr (Y == MMType::F16X2 || Y == MMType::BF16X2) {
      static_assert(TILESCALE_MULTIMEM_PTX82_OK || dependent_false<T>::value,
                    "packed float16/bfloat16 multimem_ld_reduce (.acc::f32) needs CUDA Toolkit 12.2+ (PTX ISA 8.2)");
      if constexpr (Y == MMType::F16X2) { TILESCALE_MM_LD32(PFX, ".add.acc::f32.f16x2") }
      else { TILESCALE_MM_LD32(PFX, ".add.acc::f32.bf16x2") }
    } else { static_assert(dependent_false<T>::value, "multimem_ld_reduce: no PTX add for this type"); }
  } else if constexpr (Op == MMOp::MIN) {
    TILESCALE_MM_INT_OPS(TILESCALE_MM_LD32, TILESCALE_MM_LD64, PFX, ".min")
    else if constexpr (Y == MMType::F16X2) { TILESCALE_MM_LD32(PFX, ".min.f16x2") }
    else if constexpr (Y == MMType::BF16X2) { TILESCALE_MM_LD32(PFX, ".min.bf16x2") }
    else { static_assert(dependent_false<T>::value, "multimem_ld_reduce: no PTX min for this type"); }
  } else if constexpr (Op == MMOp::MAX) {
    TILESCALE_MM_INT_OPS(TILESCALE_MM_LD32, TILESCALE_MM_LD64, PFX, ".max")
    else if constexpr (Y == MMType::F16X2) { TILESCALE_MM_LD32(PFX, ".max.f16x2") }
    else if constexpr (Y == MMType::BF16X2) { TILESCALE_MM_LD32(PFX, ".max.bf16x2") }
    else { static_assert(dependent_false<T>::value, "multimem_ld_reduce: no PTX max for this type"); }
  } else {
    static_assert(dependent_false<T>::value, "multimem_ld_reduce needs ADD, MIN or MAX");
  }
#undef PFX
  if constexpr (sizeof(R) == 8) return r64;
  else return r32;
}

/// Reduce-load one 32/64-bit element from the multimem address `ptr`.
template <MMOp Op, MMType Y, typename T> TILESCALE_DEVICE value_t<T> multimem_ld_reduce(const T* ptr) {
  static_assert(sizeof(T) * 8 == mm_bits<Y>::value && Y != MMType::F16X2 && Y != MMType::BF16X2,
                "multimem_ld_reduce: element size does not match the PTX type");
  if constexpr (sizeof(T) == 8) return bit_cast<value_t<T>>(mm_ld_reduce_bits<Op, Y, unsigned long long>(ptr));
  else return bit_cast<value_t<T>>(mm_ld_reduce_bits<Op, Y, unsigned int>(ptr));
}

/// Reduce-load the packed pair ptr[0:2] (2-byte elements) into out[0:2] (4-byte aligned).
template <MMOp Op, MMType Y, typename T, typename U> TILESCALE_DEVICE void multimem_ld_reduce_x2(const T* ptr, U* out) {
  static_assert(sizeof(T) == 2 && sizeof(U) == 2 && (Y == MMType::F16X2 || Y == MMType::BF16X2),
                "multimem_ld_reduce_x2 handles float16/bfloat16 pairs");
  *reinterpret_cast<unsigned int*>(out) = mm_ld_reduce_bits<Op, Y, unsigned int>(ptr);
}

/// multimem.st.<SEM>.sys.global.<b32|b64> of raw bits.
template <bool RELEASE, typename T, typename V> TILESCALE_DEVICE void mm_st_bits(T* ptr, V bits) {
  static_assert(mm_check<T>::ok, "");
  static_assert(sizeof(V) == 4 || sizeof(V) == 8, "multimem_st stores 32- or 64-bit words");
  if constexpr (sizeof(V) == 4) {
    unsigned int v32 = bits;
    if constexpr (RELEASE) { TILESCALE_MM_ST32("multimem.st.release.sys.global", ".u32") }
    else { TILESCALE_MM_ST32("multimem.st.relaxed.sys.global", ".b32") }
  } else {
    unsigned long long v64 = bits;
    if constexpr (RELEASE) { TILESCALE_MM_ST64("multimem.st.release.sys.global", ".u64") }
    else { TILESCALE_MM_ST64("multimem.st.relaxed.sys.global", ".b64") }
  }
}

/// Broadcast one 32/64-bit element to the multimem address `ptr` (multimem.st.relaxed).
template <typename T> TILESCALE_DEVICE void multimem_st(T* ptr, value_t<T> value) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "multimem_st supports 32- and 64-bit elements");
  if constexpr (sizeof(T) == 8) mm_st_bits<false>(ptr, bit_cast<unsigned long long>(value));
  else mm_st_bits<false>(ptr, bit_cast<unsigned int>(value));
}

/// Broadcast the packed pair src[0:2] (2-byte elements, 4-byte aligned) to ptr[0:2].
template <typename T, typename U> TILESCALE_DEVICE void multimem_st_x2(T* ptr, const U* src) {
  static_assert(sizeof(T) == 2 && sizeof(U) == 2, "multimem_st_x2 handles 2-byte pairs");
  mm_st_bits<false>(ptr, *reinterpret_cast<const unsigned int*>(src));
}

/// multimem.red.<SEM>.sys.global.<op>.<type> of raw bits.
template <MMOp Op, MMType Y, bool RELEASE, typename T, typename V> TILESCALE_DEVICE void mm_red_bits(T* ptr, V bits) {
  static_assert(mm_check<T>::ok, "");
  unsigned int v32 = 0;
  unsigned long long v64 = 0;
  if constexpr (sizeof(V) == 8) v64 = bits;
  else v32 = bits;
#define TILESCALE_MM_RED(PFX)                                                              \
  if constexpr (Op == MMOp::ADD) {                                                        \
    if constexpr (Y == MMType::F32) { TILESCALE_MM_ST32(PFX, ".add.f32") }                \
    else if constexpr (Y == MMType::F64) { TILESCALE_MM_ST64(PFX, ".add.f64") }           \
    else if constexpr (Y == MMType::U32) { TILESCALE_MM_ST32(PFX, ".add.u32") }           \
    else if constexpr (Y == MMType::S32) { TILESCALE_MM_ST32(PFX, ".add.s32") }           \
    else if constexpr (Y == MMType::U64) { TILESCALE_MM_ST64(PFX, ".add.u64") }           \
    else if constexpr (Y == MMType::F16X2) { TILESCALE_MM_ST32(PFX, ".add.f16x2") }       \
    else if constexpr (Y == MMType::BF16X2) { TILESCALE_MM_ST32(PFX, ".add.bf16x2") }     \
    else { static_assert(dependent_false<T>::value, "multimem_red: no PTX add for this type"); } \
  } else if constexpr (Op == MMOp::MIN) {                                                 \
    TILESCALE_MM_INT_OPS(TILESCALE_MM_ST32, TILESCALE_MM_ST64, PFX, ".min")               \
    else { static_assert(dependent_false<T>::value, "multimem_red: no PTX min for this type"); } \
  } else if constexpr (Op == MMOp::MAX) {                                                 \
    TILESCALE_MM_INT_OPS(TILESCALE_MM_ST32, TILESCALE_MM_ST64, PFX, ".max")               \
    else { static_assert(dependent_false<T>::value, "multimem_red: no PTX max for this type"); } \
  } else {                                                                                \
    static_assert(dependent_false<T>::value, "multimem_red needs ADD, MIN or MAX");       \
  }
  if constexpr (RELEASE) { TILESCALE_MM_RED("multimem.red.release.sys.global") }
  else { TILESCALE_MM_RED("multimem.red.relaxed.sys.global") }
#undef TILESCALE_MM_RED
}

/// Reduce-store one 32/64-bit element into the multimem address `ptr`.
template <MMOp Op, MMType Y, typename T> TILESCALE_DEVICE void multimem_red(T* ptr, value_t<T> value) {
  static_assert(sizeof(T) * 8 == mm_bits<Y>::value && Y != MMType::F16X2 && Y != MMType::BF16X2,
                "multimem_red: element size does not match the PTX type");
  if constexpr (sizeof(T) == 8) mm_red_bits<Op, Y, false>(ptr, bit_cast<unsigned long long>(value));
  else mm_red_bits<Op, Y, false>(ptr, bit_cast<unsigned int>(value));
}

/// Reduce-store the packed pair src[0:2] (2-byte elements, 4-byte aligned) into ptr[0:2].
template <MMOp Op, MMType Y, typename T, typename U> TILESCALE_DEVICE void multimem_red_x2(T* ptr, const U* src) {
  static_assert(sizeof(T) == 2 && sizeof(U) == 2 && (Y == MMType::F16X2 || Y == MMType::BF16X2),
                "multimem_red_x2 handles float16/bfloat16 pairs");
  mm_red_bits<Op, Y, false>(ptr, *reinterpret_cast<const unsigned int*>(src));
}

/// Signal: multimem.st.release.sys.global.{u32,u64} of `value` to every replica of *ptr.
template <typename T> TILESCALE_DEVICE void multimem_signal(T* ptr, value_t<T> value) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "multimem_signal needs a uint32 or uint64 flag");
  if constexpr (sizeof(T) == 8) mm_st_bits<true>(ptr, bit_cast<unsigned long long>(value));
  else mm_st_bits<true>(ptr, bit_cast<unsigned int>(value));
}

/// Signal add: multimem.red.release.sys.global.add.{u32,s32,u64} on every replica of *ptr.
template <MMType Y, typename T> TILESCALE_DEVICE void multimem_signal_add(T* ptr, value_t<T> value) {
  static_assert(Y == MMType::U32 || Y == MMType::S32 || Y == MMType::U64,
                "multimem_signal_add needs a uint32, int32 or uint64 flag");
  if constexpr (sizeof(T) == 8) mm_red_bits<MMOp::ADD, Y, true>(ptr, bit_cast<unsigned long long>(value));
  else mm_red_bits<MMOp::ADD, Y, true>(ptr, bit_cast<unsigned int>(value));
}

/// Bulk store (Op NONE) or bulk reduce-store of `bytes` bytes (a multiple of 16) from shared
/// memory `smem` to the multimem address `ptr`, in the calling thread's bulk async-group.
/// One elected thread calls it; the caller commits and waits (T.tma_store_arrive /
/// T.tma_store_wait) and makes the shared writes visible first (T.fence_proxy_async).
/// Y is the element type of the reduction (F32, F16X2 for float16, BF16X2 for bfloat16).
///
/// Needs CUDA Toolkit 13.1+ (PTX ISA 9.1 multimem.cp.async.bulk / multimem.cp.reduce.async
/// .bulk); the instruction forms below follow PTX ISA 9.1 and have not been assembled here,
/// since this code base is built with nvcc 13.0, where this helper is a compile error.
template <MMOp Op, MMType Y, typename T, typename U>
TILESCALE_DEVICE void multimem_tma_store(T* ptr, const U* smem, unsigned int bytes) {
  static_assert(mm_check<T>::ok, "");
  static_assert(TILESCALE_MULTIMEM_BULK_OK || dependent_false<T>::value,
                "tilescale::multimem_tma_store needs CUDA Toolkit 13.1+ (PTX ISA 9.1 multimem.cp.async.bulk); "
                "this nvcc is older: upgrade the toolkit or use T.multimem_st / T.multimem_red");
#if TILESCALE_MULTIMEM_BULK_OK && defined(__CUDA_ARCH__)
  unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
#define TILESCALE_MM_BULK(SFX)                                                             \
  asm volatile("multimem.cp" SFX " [%0], [%1], %2;" ::"l"(ptr), "r"(s), "r"(bytes) : "memory");
  if constexpr (Op == MMOp::NONE) { TILESCALE_MM_BULK(".async.bulk.global.shared::cta.bulk_group") }
  else if constexpr (Op == MMOp::ADD && Y == MMType::F32) { TILESCALE_MM_BULK(".reduce.async.bulk.global.shared::cta.bulk_group.add.f32") }
  else if constexpr (Op == MMOp::ADD && Y == MMType::F16X2) { TILESCALE_MM_BULK(".reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16") }
  else if constexpr (Op == MMOp::ADD && Y == MMType::BF16X2) { TILESCALE_MM_BULK(".reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16") }
  else if constexpr (Op == MMOp::MIN && Y == MMType::F16X2) { TILESCALE_MM_BULK(".reduce.async.bulk.global.shared::cta.bulk_group.min.f16") }
  else if constexpr (Op == MMOp::MIN && Y == MMType::BF16X2) { TILESCALE_MM_BULK(".reduce.async.bulk.global.shared::cta.bulk_group.min.bf16") }
  else if constexpr (Op == MMOp::MAX && Y == MMType::F16X2) { TILESCALE_MM_BULK(".reduce.async.bulk.global.shared::cta.bulk_group.max.f16") }
  else if constexpr (Op == MMOp::MAX && Y == MMType::BF16X2) { TILESCALE_MM_BULK(".reduce.async.bulk.global.shared::cta.bulk_group.max.bf16") }
  else { static_assert(dependent_false<T>::value, "multimem_tma_store: unsupported reduction/type"); }
#undef TILESCALE_MM_BULK
#endif
}

}  // namespace tilescale

#undef TILESCALE_MM_LD32
#undef TILESCALE_MM_LD64
#undef TILESCALE_MM_ST32
#undef TILESCALE_MM_ST64
#undef TILESCALE_MM_INT_OPS
