"""The bad-input tally of the kernel intrinsics (issue 39, docs/reliability.md).

Every public TileScale intrinsic (each name tilescale-lang adds to or wraps on
``tilelang.language``) gets, for every argument it takes, at least one bad input that must
raise ``TypeError``/``ValueError`` naming that argument while the kernel is traced (or, if it
got past tracing, lowered with :func:`tilescale_lang.codegen.cuda_source`).

The probes are the rejection tables of the other test modules (``test_bad_inputs``,
``test_rejections``, ``test_signals_teams``, ``test_multimem``), reused as they are, plus
:data:`NEW` below for the arguments they leave out.  :func:`test_every_public_argument_has_a_case`
compares the public names and their ``inspect.signature`` with what the probes cover, so a new
intrinsic or argument without a case fails it.  Counts for the docs: :data:`TALLY`.
"""

from __future__ import annotations

import inspect
import re
import types

import pytest
import tilelang.language as T
from lang_helpers import lower_source

import test_bad_inputs
import test_multimem
import test_rejections
import test_signals_teams
from tilescale_lang import team as TM
from tilescale_lang._extension import intrinsics
from tilescale_lang.validation import MAX_PE


# ------------------------------------------------------------------------------ public names
def public_names() -> dict:
    """Name -> object of everything tilescale-lang puts on ``tilelang.language``: the
    registry (:func:`tilescale_lang._extension.intrinsics`) and the stock names it wraps
    (``T.copy``, ``T.atomic_add``, ...: whatever on ``T`` is defined in ``tilescale_lang``)."""
    names = dict(intrinsics())
    for name in dir(T):
        obj = getattr(T, name)
        if str(getattr(obj, "__module__", "") or "").startswith("tilescale_lang"):
            names[name] = obj
    return names


PUBLIC = public_names()

#: Names that take no argument, so have no bad input (checked: their signature is empty).
NO_ARGUMENTS = frozenset({
    "get_rank", "get_num_ranks",          # rank queries
    "fence_cta", "fence_gpu", "fence_sys",  # memory fences
    "quiet", "fence",                     # NVSHMEM-style completion / ordering
    "get_pe", "get_pe_num",               # upstream's NVSHMEM spellings of the rank queries
})
#: Exported constants, not intrinsics (strings and an Enum; they are the *good* values of
#: ``sig_op``/``cmp``/``reduce_op``, whose bad values are probed on the intrinsics).
CONSTANTS = frozenset({
    "SIGNAL_SET", "SIGNAL_ADD", "CMP_EQ", "CMP_NE", "CMP_GT", "CMP_GE", "CMP_LT", "CMP_LE",
    "MultimemReduceOp", "CmpType", "Amo",
})
#: (intrinsic, argument) pairs with no bad value of their own, and why.
NO_BAD_VALUE = frozenset({
    # forwarded untouched to stock TileLang's T.atomic_add (its own argument checks apply)
    ("atomic_add", "use_tma"),
    ("atomic_add", "annotations"),
})


def required_arguments() -> set[tuple[str, str]]:
    """Every (intrinsic, named argument) pair that needs a probe (``**kwargs`` forwarded to
    stock TileLang excluded)."""
    need = set()
    for name, obj in PUBLIC.items():
        if name in CONSTANTS or name in NO_ARGUMENTS:
            continue
        for p in inspect.signature(obj).parameters.values():
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                need.add((name, p.name))
    return need - NO_BAD_VALUE


def _params(name: str) -> list[str]:
    return list(inspect.signature(PUBLIC[name]).parameters)


def _names(text: str, word: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])", text) is not None


# ------------------------------------------------------------------------------ probes
class Probe(types.SimpleNamespace):
    """One bad input: ``run()`` traces and lowers a kernel calling ``intrinsic`` badly; it
    must raise ``exc`` whose message matches ``match`` and names ``argument``."""


def _intrinsic_of(body) -> str:
    called = [n for n in body.__code__.co_names if n in PUBLIC and n not in CONSTANTS]
    assert len(called) == 1, (body, called)
    return called[0]


def _argument_of(intrinsic: str, text: str) -> str | None:
    """The argument of ``intrinsic`` a reused case's expected message names first."""
    hits = [(m.start(), p) for p in _params(intrinsic)
            for m in [re.search(rf"(?<![A-Za-z0-9_]){re.escape(p)}(?![A-Za-z0-9_])", text)] if m]
    return min(hits)[1] if hits else None


def _reused() -> list[Probe]:
    out = []

    def add(table, i, body, exc, match, run):
        name = _intrinsic_of(body)
        text = match if isinstance(match, str) else " ".join(match)
        pattern = match if isinstance(match, str) else "".join(f"(?=[\\s\\S]*{re.escape(w)})" for w in match)
        out.append(Probe(id=f"{table}[{i}]", intrinsic=name, argument=_argument_of(name, text),
                         exc=exc, match=pattern, run=run))

    for key, (body, exc, match) in sorted(test_bad_inputs.REJECTED.items()):
        add("test_bad_inputs", key, body, exc, match, lambda b=body: test_bad_inputs._trace(b))
    for i, (body, exc, word) in enumerate(test_rejections.CASES):
        add("test_rejections", i, body, exc, word, lambda b=body: lower_source(test_rejections.trace(b)))
    for i, (body, exc, word) in enumerate(test_signals_teams.REJECT):
        add("test_signals_teams", i, body, exc, word, lambda b=body: lower_source(test_signals_teams.build(b)))
    for i, (dtype, local, body, exc, words) in enumerate(test_multimem.REJECT):
        add("test_multimem", i, body, exc, words,
            lambda b=body, d=dtype, lo=local: lower_source(test_multimem.build(b, dtype=d, local=lo)))
    for i, (body, dtype, words) in enumerate(test_multimem.TMA_REJECT):
        add("test_multimem.TMA", i, body, ValueError, words, lambda b=body, d=dtype: lower_source(test_multimem._tma(b, d)))
    return out


def _trace(body):
    """Trace and lower a kernel whose body is ``body(k)``, ``k`` holding: global F (uint32),
    Ff (float32), G (uint64), A/B (float32, 64), M (float32, 8x8), H (float16, 64), Team,
    P (a (4, 17) uint64 profiler buffer, capacity 8), MC (float32 64x64); shared S (float32,
    64), Sm (float32 64x64), Sf (uint32, 4); run-time n (int32)."""

    @T.prim_func
    def kern(F: T.Tensor((8,), "uint32"), Ff: T.Tensor((8,), "float32"), G: T.Tensor((8,), "uint64"),
             A: T.Tensor((64,), "float32"), B: T.Tensor((64,), "float32"), M: T.Tensor((8, 8), "float32"),
             H: T.Tensor((64,), "float16"), Team: T.Tensor(TM.TEAM_SHAPE, "int32"), P: T.Tensor((4, 17), "uint64"),
             MC: T.Tensor((64, 64), "float32"), n: T.int32):
        with T.Kernel(1, threads=128) as _:
            S = T.alloc_shared((64,), "float32")
            Sm = T.alloc_shared((64, 64), "float32")
            Sf = T.alloc_shared((4,), "uint32")
            body(types.SimpleNamespace(F=F, Ff=Ff, G=G, A=A, B=B, M=M, H=H, Team=Team, P=P, MC=MC, n=n, S=S, Sm=Sm,
                                       Sf=Sf))

    return lower_source(kern)


_OUT = MAX_PE + 1  # a constant PE past the metadata table

#: (intrinsic, argument, body, exception) for the arguments the reused tables leave out.
NEW: list[tuple] = [
    ("symm_at", "ptr", lambda k: T.evaluate(T.symm_at(3, 1)), TypeError),
    ("symm_at", "pe", lambda k: T.evaluate(T.symm_at(k.F[0], 1.5)), TypeError),
    ("symm_at", "pe", lambda k: T.evaluate(T.symm_at(k.F[0], _OUT)), ValueError),
    ("put_warp", "dst_pe", lambda k: T.put_warp(k.A, k.B, 4, dst_pe=_OUT), ValueError),
    ("get_warp", "src", lambda k: T.get_warp(5, k.B, 4, src_pe=1), TypeError),
    ("get_warp", "dst", lambda k: T.get_warp(k.A, 5, 4, src_pe=1), TypeError),
    ("get_warp", "src_pe", lambda k: T.get_warp(k.A, k.B, 4, src_pe=True), TypeError),
    ("get_warp", "unroll_factor", lambda k: T.get_warp(k.A, k.B, 4, 1, unroll_factor=1.5), TypeError),
    ("get_warp", "enable_aggressive_vectorize", lambda k: T.get_warp(k.A, k.B, 4, 1, enable_aggressive_vectorize=1.5), TypeError),
    ("put_block", "dst", lambda k: T.put_block(k.A, k.S, 4, dst_pe=1), ValueError),
    ("put_block", "dst_pe", lambda k: T.put_block(k.A, k.B, 4, dst_pe=-2), ValueError),
    ("get_block", "dst", lambda k: T.get_block(k.A, k.M[0:2, 0:4], 8, src_pe=1), ValueError),
    ("get_block", "size", lambda k: T.get_block(k.A, k.B, 1.5, src_pe=1), TypeError),
    ("get_block", "src_pe", lambda k: T.get_block(k.A, k.B, 4, src_pe=_OUT), ValueError),
    ("ld", "src_pe", lambda k: T.evaluate(T.ld(k.F[0], src_pe=1.5)), TypeError),
    ("st", "scope", lambda k: T.st(k.F[0], 1, scope="cluster"), ValueError),
    ("st", "dst_pe", lambda k: T.st(k.F[0], 1, dst_pe=True), TypeError),
    ("atom_add", "value", lambda k: T.evaluate(T.atom_add(k.F[0], 1.5)), TypeError),
    ("notify", "ptr", lambda k: T.notify(3, 1), TypeError),
    ("notify", "peer", lambda k: T.notify(k.F[0], -2), ValueError),
    ("notify", "signal", lambda k: T.notify(k.F[0], 1, signal=1.5), TypeError),
    ("profile_event", "buf", lambda k: T.profile_event(k.P[0, 0], 1), TypeError),
    ("profile_event", "task", lambda k: T.profile_event(k.P, -1), ValueError),
    ("profile_event", "is_start", lambda k: T.profile_event(k.P, 1, is_start=1.5), TypeError),
    ("profile_event", "enabled", lambda k: T.profile_event(k.P, 1, enabled="yes"), TypeError),
    ("profile_event", "slot", lambda k: T.profile_event(k.P, 1, slot=8), ValueError),
    ("multimem_ld_reduce", "reduce_op", lambda k: T.multimem_ld_reduce(k.MC, k.Sm, "mul"), ValueError),
    ("multimem_st", "src", lambda k: T.multimem_st(3, k.MC), TypeError),
    ("multimem_red", "src", lambda k: T.multimem_red(3, k.MC), TypeError),
    ("multimem_signal", "value", lambda k: T.multimem_signal(k.F[0], 1.5), TypeError),
    ("multimem_signal_add", "value", lambda k: T.multimem_signal_add(k.F[0], 1.5), TypeError),
    ("multimem_tma_store", "reduce_op", lambda k: T.multimem_tma_store(k.Sm, k.MC, "mul"), ValueError),
    ("signal_op", "pe", lambda k: T.signal_op(k.G[0], 1, "set", pe=-2), ValueError),
    ("signal_wait_until", "sig_addr", lambda k: T.evaluate(T.signal_wait_until(k.Ff[0], "eq", 1)), TypeError),
    ("signal_wait_until", "value", lambda k: T.evaluate(T.signal_wait_until(k.G[0], "eq", 1.5)), TypeError),
    ("team_translate_pe", "team", lambda k: T.evaluate(T.team_translate_pe(k.F, 0)), TypeError),
    ("broadcast_block", "team", lambda k: T.broadcast_block(k.F, k.A, k.B, 4, 0), TypeError),
    ("broadcast_block", "src", lambda k: T.broadcast_block(k.Team, k.A, 5, 4, 0), TypeError),
    ("fcollect_block", "team", lambda k: T.fcollect_block(k.F, k.A, k.B, 4), TypeError),
    ("fcollect_block", "dst", lambda k: T.fcollect_block(k.Team, k.S, k.B, 4), ValueError),
    ("fcollect_block", "src", lambda k: T.fcollect_block(k.Team, k.A, k.S, 4), ValueError),
    ("atomic_cas", "compare", lambda k: T.evaluate(T.atomic_cas(k.F[0], 1.5, 1)), TypeError),
    ("atomic_add", "dst", lambda k: T.atomic_add(k.S[0], 1.0, dst_pe=1), ValueError),
    ("atomic_add", "value", lambda k: T.atomic_add(k.F[0], 1.5, dst_pe=1), TypeError),
    ("atomic_add", "memory_order", lambda k: T.atomic_add(k.A[0], 1.0, memory_order="seq_cst", dst_pe=1), ValueError),
    ("atomic_add", "return_prev", lambda k: T.atomic_add(k.A[0:8], k.S[0:8], return_prev=True, dst_pe=1), ValueError),
    ("atomic_add", "dst_pe", lambda k: T.atomic_add(k.A[0], 1.0, dst_pe=-2), ValueError),
    ("atomic_addx2", "dst", lambda k: T.atomic_addx2(k.A[0], k.H[0], dst_pe=1), TypeError),
    ("atomic_addx2", "value", lambda k: T.atomic_addx2(k.H[0], k.A[0], dst_pe=1), TypeError),
    ("atomic_addx2", "return_prev", lambda k: T.atomic_addx2(k.H[0], k.H[2], return_prev=True, dst_pe=1), ValueError),
    ("atomic_addx2", "dst_pe", lambda k: T.atomic_addx2(k.H[0], k.H[2], dst_pe=1.5), TypeError),
    ("copy", "dst_pe", lambda k: T.copy(k.S, k.A[0:64], dst_pe=1.5), TypeError),
    ("tma_copy", "src", lambda k: T.tma_copy(k.S, k.A[0:64], src_pe=1), ValueError),
    ("tma_copy", "dst", lambda k: T.tma_copy(k.A[0:64], k.S, dst_pe=1), ValueError),
    ("tma_copy", "src_pe", lambda k: T.tma_copy(k.A[0:64], k.S, src_pe=-2), ValueError),
    ("tma_copy", "dst_pe", lambda k: T.tma_copy(k.S, k.A[0:64], dst_pe=8), ValueError),
]

# The families: every member gets every argument probed (the tables above probe some).
for _name in ("put_nbi_block", "put_nbi_warp", "get_nbi_block", "get_nbi_warp"):
    NEW += [
        (_name, "src", lambda k, f=_name: getattr(T, f)(5, k.B, 4, 1), TypeError),
        (_name, "dst", lambda k, f=_name: getattr(T, f)(k.A, 5, 4, 1), TypeError),
        (_name, "size", lambda k, f=_name: getattr(T, f)(k.A, k.B, -1, 1), ValueError),
        (_name, "pe", lambda k, f=_name: getattr(T, f)(k.A, k.B, 4, -2), ValueError),
    ]
for _name, _pe in (("put_rows_block", "dst_pe"), ("get_rows_block", "src_pe")):
    NEW += [  # (src, dst, rows, row_size, src_stride, dst_stride, pe)
        (_name, "src", lambda k, f=_name: getattr(T, f)(5, k.B, 2, 4, 8, 8, 1), TypeError),
        (_name, "dst", lambda k, f=_name: getattr(T, f)(k.A, 5, 2, 4, 8, 8, 1), TypeError),
        (_name, "rows", lambda k, f=_name: getattr(T, f)(k.A, k.B, -1, 4, 8, 8, 1), ValueError),
        (_name, "row_size", lambda k, f=_name: getattr(T, f)(k.A, k.B, 2, 1.5, 8, 8, 1), TypeError),
        (_name, "src_stride", lambda k, f=_name: getattr(T, f)(k.A, k.B, 2, 4, 2**62, 8, 1), ValueError),
        (_name, "dst_stride", lambda k, f=_name: getattr(T, f)(k.A, k.B, 2, 4, 8, 2, 1), ValueError),
        (_name, _pe, lambda k, f=_name: getattr(T, f)(k.A, k.B, 2, 4, 8, 8, _OUT), ValueError),
        (_name, "unroll_factor", lambda k, f=_name: getattr(T, f)(k.A, k.B, 2, 4, 8, 8, 1, unroll_factor=0), ValueError),
    ]
NEW += [  # the Lamport exchange: 16-byte float vectors, the remote side global
    ("lamport_put", "src", lambda k: T.lamport_put(k.F[0:4], k.A[0:4], dst_pe=1), TypeError),
    ("lamport_put", "src", lambda k: T.lamport_put(k.A[62:64], k.B[0:4], dst_pe=1), ValueError),
    ("lamport_put", "dst", lambda k: T.lamport_put(k.A[0:4], k.S[0:4], dst_pe=1), ValueError),
    ("lamport_put", "dst", lambda k: T.lamport_put(k.A[0:4], k.H[0:8], dst_pe=1), TypeError),
    ("lamport_put", "dst_pe", lambda k: T.lamport_put(k.A[0:4], k.B[0:4], dst_pe=_OUT), ValueError),
    ("lamport_get", "src", lambda k: T.lamport_get(5, k.S[0:4], src_pe=1), TypeError),
    ("lamport_get", "src", lambda k: T.lamport_get(k.S[0:4], k.A[0:4], src_pe=1), ValueError),
    ("lamport_get", "dst", lambda k: T.lamport_get(k.A[0:4], k.F[0:4]), TypeError),
    ("lamport_get", "src_pe", lambda k: T.lamport_get(k.A[0:4], k.S[0:4], src_pe=True), TypeError),
    ("lamport_clear", "dst", lambda k: T.lamport_clear(k.S[0:4]), ValueError),
    ("lamport_clear", "dst", lambda k: T.lamport_clear(k.F[0:4]), TypeError),
    ("lamport_clear", "dst_pe", lambda k: T.lamport_clear(k.A[0:4], dst_pe=1.5), TypeError),
]
for _name in ("put_signal_block", "put_signal_warp", "put_signal_nbi_block", "put_signal_nbi_warp"):
    NEW += [
        (_name, "src", lambda k, f=_name: getattr(T, f)(5, k.B, 4, k.G[0], 1), TypeError),
        (_name, "dst", lambda k, f=_name: getattr(T, f)(k.A, k.M[0:2, 0:4], 8, k.G[0], 1), ValueError),
        (_name, "size", lambda k, f=_name: getattr(T, f)(k.A, k.B, 2**62, k.G[0], 1), ValueError),
        (_name, "sig_addr", lambda k, f=_name: getattr(T, f)(k.A, k.B, 4, k.Ff[0], 1), TypeError),
        (_name, "signal", lambda k, f=_name: getattr(T, f)(k.A, k.B, 4, k.G[0], 1.5), TypeError),
        (_name, "sig_op", lambda k, f=_name: getattr(T, f)(k.A, k.B, 4, k.G[0], 1, "xor"), ValueError),
        (_name, "dst_pe", lambda k, f=_name: getattr(T, f)(k.A, k.B, 4, k.G[0], 1, "set", _OUT), ValueError),
    ]
for _name in [f"{d}mem{n}_{s}" for d in ("put", "get") for n in ("", "_nbi") for s in ("block", "warp")]:
    NEW += [  # upstream's NVSHMEM spellings (dest, src, bytes, pe)
        (_name, "dest", lambda k, f=_name: getattr(T, f)(5, k.A, 16, 1), TypeError),
        (_name, "src", lambda k, f=_name: getattr(T, f)(k.B, 5, 16, 1), TypeError),
        (_name, "nelems", lambda k, f=_name: getattr(T, f)(k.B, k.A, 257, 1), ValueError),
        (_name, "pe", lambda k, f=_name: getattr(T, f)(k.B, k.A, 16, True), TypeError),
    ]
for _name in ("putmem_signal_block", "putmem_signal_warp", "putmem_signal_nbi_block", "putmem_signal_nbi_warp"):
    NEW += [
        (_name, "dest", lambda k, f=_name: getattr(T, f)(k.S, k.A, 16, k.G[0], 1, 9, 1), ValueError),
        (_name, "src", lambda k, f=_name: getattr(T, f)(k.B, 5, 16, k.G[0], 1, 9, 1), TypeError),
        (_name, "nelems", lambda k, f=_name: getattr(T, f)(k.B, k.A, -4, k.G[0], 1, 9, 1), ValueError),
        (_name, "sig_addr", lambda k, f=_name: getattr(T, f)(k.B, k.A, 16, k.Ff[0], 1, 9, 1), TypeError),
        (_name, "signal", lambda k, f=_name: getattr(T, f)(k.B, k.A, 16, k.G[0], 1.5, 9, 1), TypeError),
        (_name, "sig_op", lambda k, f=_name: getattr(T, f)(k.B, k.A, 16, k.G[0], 1, 4, 1), ValueError),
        (_name, "pe", lambda k, f=_name: getattr(T, f)(k.B, k.A, 16, k.G[0], 1, 10, _OUT), ValueError),
    ]
for _name in ("wait_eq", "wait_ne", "wait_ge", "wait_le", "wait_gt", "wait_lt"):
    NEW += [
        (_name, "value", lambda k, f=_name: T.evaluate(getattr(T, f)(k.S[0], 1, peer=1)), ValueError),
        (_name, "expected", lambda k, f=_name: T.evaluate(getattr(T, f)(k.F[0], 1.5)), TypeError),
        (_name, "peer", lambda k, f=_name: T.evaluate(getattr(T, f)(k.F[0], 1, peer=True)), TypeError),
        (_name, "scope", lambda k, f=_name: T.evaluate(getattr(T, f)(k.F[0], 1, scope="cta")), ValueError),
        (_name, "semantics", lambda k, f=_name: T.evaluate(getattr(T, f)(k.F[0], 1, semantics="relaxed")), ValueError),
    ]
for _name in ("arrive_barrier_gpu", "wait_barrier_gpu", "sync_barrier_gpu", "barrier_blocks", "sync_blocks"):
    NEW += [(_name, "barrier", lambda k, f=_name: getattr(T, f)(k.G), TypeError),
            (_name, "barrier", lambda k, f=_name: getattr(T, f)(k.Sf), ValueError)]
for _name in ("team_rank", "team_num_ranks", "team_barrier"):
    NEW += [(_name, "team", lambda k, f=_name: T.evaluate(getattr(T, f)(k.Ff)), TypeError)]

PROBES: list[Probe] = _reused() + [
    Probe(id=f"new[{i}]:{name}.{arg}", intrinsic=name, argument=arg, exc=exc, match="", run=lambda b=body: _trace(b))
    for i, (name, arg, body, exc) in enumerate(NEW)
]
COVERED = {(p.intrinsic, p.argument) for p in PROBES if p.argument is not None}
REQUIRED = required_arguments()
#: Counts cited by docs/reliability.md.
TALLY = {
    "probes": len(PROBES),
    "intrinsics": len({p.intrinsic for p in PROBES}),
    "arguments": len(REQUIRED & COVERED),
    "argument_free": len(NO_ARGUMENTS),
}


@pytest.mark.parametrize("probe", PROBES, ids=[p.id for p in PROBES])
def test_bad_input_raises_naming_the_argument(probe):
    with pytest.raises((TypeError, ValueError)) as info:
        probe.run()
    text = str(info.value)
    assert isinstance(info.value, probe.exc), (probe.intrinsic, probe.argument, repr(info.value))
    if probe.match:
        assert re.search(probe.match, text), (probe.match, text)
    if probe.argument is not None:
        assert _names(text, probe.argument), f"{probe.intrinsic}: the error does not name {probe.argument!r}: {text}"


def test_every_public_argument_has_a_case():
    callables = {n for n in PUBLIC if n not in CONSTANTS}
    assert NO_ARGUMENTS <= callables and CONSTANTS <= set(PUBLIC)
    for name in NO_ARGUMENTS:  # the allow-list cannot hide an intrinsic that takes arguments
        assert not inspect.signature(PUBLIC[name]).parameters, name
    assert NO_BAD_VALUE <= {(n, p) for n in callables for p in _params(n)}
    probed = {p.intrinsic for p in PROBES}
    assert callables - NO_ARGUMENTS - probed == set(), "public intrinsics without a bad-input case"
    assert sorted(REQUIRED - COVERED) == [], "arguments without a bad-input case"
    assert TALLY["intrinsics"] + TALLY["argument_free"] == len(callables)
