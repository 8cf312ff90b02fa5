"""Bad inputs to the kernel intrinsics (issue 39): each one used to lower to code that
computes something else (a copy past the buffer, an integer add of a float's bits, a wait
that never completes) or to fail late without naming the argument.  Now each is an error
naming the argument while the kernel is traced; the code of correct programs is unchanged.

CPU only: tracing, lowering to CUDA source and (where a toolkit is present) PTX.
"""

from __future__ import annotations

import pytest
import tilelang.language as T
from lang_helpers import kernel_body, lower_source, needs_toolkit, nvcc_ptx

from tilescale_lang import team as TM


def _trace(body):
    """Trace a kernel whose body is ``body(F, Ff, G, M, A, B, Team, S, n)``; return its source."""

    @T.prim_func
    def k(F: T.Tensor((8,), "uint32"), Ff: T.Tensor((8,), "float32"), G: T.Tensor((8,), "uint64"),
          M: T.Tensor((8, 8), "float32"), A: T.Tensor((64,), "float32"), B: T.Tensor((64,), "float32"),
          Team: T.Tensor(TM.TEAM_SHAPE, "int32"), n: T.int32):
        with T.Kernel(1, threads=128) as _:
            S = T.alloc_shared((64,), "float32")
            body(F, Ff, G, M, A, B, Team, S, n)

    return kernel_body(lower_source(k))


REJECTED = {
    # team collectives: the constant size is checked against src and dst like every copy
    "broadcast_n_beyond_src": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, F, F, 64, 0),
                               ValueError, r"n=64 elements exceeds src, which holds 8"),
    "broadcast_n_beyond_dst": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, F, A, 16, 0),
                               ValueError, r"n=16 elements exceeds dst, which holds 8"),
    "fcollect_n_beyond_src": (lambda F, Ff, G, M, A, B, Tm, S, n: T.fcollect_block(Tm, A, F, 64),
                              ValueError, r"n=64 elements exceeds src, which holds 8"),
    # a constant root outside any team
    "broadcast_root_negative": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, A, B, 4, -1),
                                ValueError, r"root=-1 is not a team rank"),
    "broadcast_root_beyond": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, A, B, 4, 5000),
                              ValueError, r"root=5000 is not a team rank"),
    "broadcast_root_float": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, A, B, 4, 1.5),
                             TypeError, r"root must be an integer"),
    # notify add is an integer red.add: a float flag would get its bits added to
    "notify_add_float": (lambda F, Ff, G, M, A, B, Tm, S, n: T.notify(Ff[0], 0, signal=1, sig_op="add"),
                         TypeError, r"sig_op='add' needs a 32-bit integer flag.*float32"),
    # a 2-D region is not one flat span
    "put_warp_2d_src": (lambda F, Ff, G, M, A, B, Tm, S, n: T.put_warp(M[0:2, 0:4], A, 8, dst_pe=1),
                        ValueError, r"src: region M\[0:2, 0:4\] is not contiguous.*put_warp"),
    "put_warp_2d_dst": (lambda F, Ff, G, M, A, B, Tm, S, n: T.put_warp(A, M[0:2, 0:4], 8, dst_pe=1),
                        ValueError, r"dst: region M\[0:2, 0:4\] is not contiguous"),
    "get_block_2d": (lambda F, Ff, G, M, A, B, Tm, S, n: T.get_block(M[1:3, 2:6], A, 8, src_pe=1),
                     ValueError, r"src: region M\[1:3, 2:6\] is not contiguous.*get_block"),
    "put_signal_2d": (lambda F, Ff, G, M, A, B, Tm, S, n: T.put_signal_block(M[0:4, 0:2], A, 8, F[0], 1, "set", 1),
                      ValueError, r"src: region M\[0:4, 0:2\] is not contiguous.*put_signal_block"),
    "broadcast_2d": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, M[0:2, 0:4], A, 8, 0),
                     ValueError, r"dst: region M\[0:2, 0:4\] is not contiguous.*broadcast_block"),
    # waits that never complete or silently change their value
    "wait_eq_nan": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_eq(Ff[0], float("nan"))),
                    ValueError, r"expected=nan.*never completes"),
    "wait_ne_nan_imm": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_ne(Ff[0], T.float32(float("nan")))),
                        ValueError, r"expected=nan.*returns at once"),
    "wait_u32_float_imm": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_eq(F[0], T.float32(1.5))),
                           TypeError, r"expected must be an integer for a uint32 flag, got 1.5"),
    "wait_u32_float_expr": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_eq(F[0], Ff[1])),
                            TypeError, r"expected is a float32 expression but the flag is uint32"),
    "st_u32_float_imm": (lambda F, Ff, G, M, A, B, Tm, S, n: T.st(F[0], T.float32(2.5)),
                         TypeError, r"value must be an integer for a uint32 flag"),
    "wait_f32_too_big": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_ge(Ff[0], 1e40)),
                         ValueError, r"expected=1e\+40 does not fit the float32 flag"),
    "init_barrier_negative": (lambda F, Ff, G, M, A, B, Tm, S, n: T.init_barrier_gpu(F, -1),
                              ValueError, r"expected=-1 is not a number of blocks.*0xffffffff"),
    "init_barrier_zero": (lambda F, Ff, G, M, A, B, Tm, S, n: T.init_barrier_gpu(F, 0),
                          ValueError, r"expected=0 is not a number of blocks"),
    "init_barrier1_negative": (lambda F, Ff, G, M, A, B, Tm, S, n: T.init_barrier_gpu(F[0:1], T.int32(-1)),
                               ValueError, r"expected=-1 .*one-word GPU barrier takes 1..32767"),
    "init_barrier1_too_many": (lambda F, Ff, G, M, A, B, Tm, S, n: T.init_barrier_gpu(F[0:1], 40000),
                               ValueError, r"expected=40000 .*1..32767"),
    "init_barrier_float": (lambda F, Ff, G, M, A, B, Tm, S, n: T.init_barrier_gpu(F, T.float32(2.0)),
                           TypeError, r"expected must be an integer"),
    # negative constant sizes (would be huge unsigned byte counts)
    "put_block_size_negative": (lambda F, Ff, G, M, A, B, Tm, S, n: T.put_block(A, B, T.int64(-1), dst_pe=1),
                                ValueError, r"size must be >= 0, got -1"),
    "broadcast_n_negative": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, A, B, -4, 0),
                             ValueError, r"n must be >= 0, got -4"),
    # clear errors naming the argument instead of FFI / lowering errors
    "put_block_size_huge": (lambda F, Ff, G, M, A, B, Tm, S, n: T.put_block(T.address_of(A[0]), T.address_of(B[0]), 2**70, dst_pe=1),
                            ValueError, r"size=1180591620717411303424 elements of 4 bytes .* too large"),
    "get_warp_size_2_62": (lambda F, Ff, G, M, A, B, Tm, S, n: T.get_warp(T.address_of(A[0]), T.address_of(B[0]), 2**62, 1),
                           ValueError, r"size=4611686018427387904 elements .* too large"),
    "broadcast_n_huge": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, T.address_of(A[0]), T.address_of(B[0]), 2**70, 0),
                         ValueError, r"n=1180591620717411303424 elements .* too large"),
    "wait_u32_int64_too_big": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_eq(F[0], T.int64(2**40))),
                               ValueError, r"expected=1099511627776 does not fit the uint32 flag"),
    "symm_at_shared": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.symm_at(S[0], 1)),
                       ValueError, r"ptr must be in global memory when pe selects a peer.*shared"),
    "symm_at_shared_runtime_pe": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.symm_at(S[0], n)),
                                  ValueError, r"ptr must be in global memory"),
}


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_bad_input_is_rejected_while_tracing(name):
    body, exc, match = REJECTED[name]
    with pytest.raises(exc, match=match):
        _trace(body)


ACCEPTED = {
    # contiguous regions (whole trailing rows, one row) keep their code
    "put_warp_whole_rows": (lambda F, Ff, G, M, A, B, Tm, S, n: T.put_warp(M[2:4, 0:8], A, 16, dst_pe=1),
                            "tilescale::put_warp<4, false>((&(M[16])), (&(A[0])), (uint64_t)64, 1);"),
    "put_warp_one_row": (lambda F, Ff, G, M, A, B, Tm, S, n: T.put_warp(M[3, 2:6], A, 4, dst_pe=1),
                         "tilescale::put_warp<4, false>((&(M[26])), (&(A[0])), (uint64_t)16, 1);"),
    "broadcast_in_bounds": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, A, B, 64, 0),
                            "tilescale::broadcast_block((&(Team[0])), (&(A[0])), (&(B[0])), (uint64_t)256, 0);"),
    "broadcast_runtime_root": (lambda F, Ff, G, M, A, B, Tm, S, n: T.broadcast_block(Tm, A, B, 4, n),
                               "tilescale::broadcast_block((&(Team[0])), (&(A[0])), (&(B[0])), (uint64_t)16, n);"),
    "fcollect_in_bounds": (lambda F, Ff, G, M, A, B, Tm, S, n: T.fcollect_block(Tm, A, F, 8),
                           "tilescale::fcollect_block((&(Team[0])), (&(A[0])), (&(F[0])), (uint64_t)32);"),
    "notify_set_float": (lambda F, Ff, G, M, A, B, Tm, S, n: T.notify(Ff[0], 0, signal=1.5),
                         "tilescale::notify<false>((&(Ff[0])), 0, 0x1.8p+0f/*1.500000e+00*/);"),
    "notify_add_int": (lambda F, Ff, G, M, A, B, Tm, S, n: T.notify(F[0], 0, signal=1, sig_op="add"),
                       "tilescale::notify<true>((&(F[0])), 0, (uint)1);"),
    "wait_u32_int64_imm": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_eq(F[0], T.int64(5))), "(&(F[0])), (uint)5);"),
    "wait_u32_int64_minus_one": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_eq(F[0], T.int64(-1))),
                                 "(&(F[0])), (uint)4294967295);"),
    "wait_u64_top_bit": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_eq(G[0], 2**63)),
                         "(&(G[0])), (uint64_t)9223372036854775808);"),
    "wait_u64_max": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_eq(G[0], 2**64 - 1)),
                     "(&(G[0])), (uint64_t)18446744073709551615);"),
    "wait_f32_inf": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.wait_ge(Ff[0], float("inf"))), "CUDART_INF_F"),
    "init_barrier_runtime": (lambda F, Ff, G, M, A, B, Tm, S, n: T.init_barrier_gpu(F, n),
                             "tilescale::init_barrier_gpu((&(F[0])), ((uint)n));"),
    "init_barrier1_max": (lambda F, Ff, G, M, A, B, Tm, S, n: T.init_barrier_gpu(F[0:1], 32767),
                          "tilescale::init_barrier_gpu1((&(F[0])), (uint)32767);"),
    "symm_at_local_shared": (lambda F, Ff, G, M, A, B, Tm, S, n: T.evaluate(T.symm_at(S[0], -1)), ""),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_good_input_keeps_its_code(name):
    body, expected = ACCEPTED[name]
    assert expected in _trace(body)


@needs_toolkit
def test_notify_set_on_a_float_flag_stores_the_float(tmp_path):
    """``set`` on a float flag is a release store of the float's own bits (1.5f = 0x3fc00000)."""

    @T.prim_func
    def k(Ff: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=32) as _:
            T.notify(Ff[0], -1, signal=1.5)

    ptx = nvcc_ptx(lower_source(k), tmp_path)
    assert "st.release.sys" in ptx and ("1069547520" in ptx or "0f3FC00000" in ptx), ptx[-2000:]
