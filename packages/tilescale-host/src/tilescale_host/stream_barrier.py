"""``barrier_all_on_stream(stream=None, group=None)``: a barrier across ranks enqueued on a
CUDA stream, with no host synchronisation (Triton-distributed's
``nvshmem_barrier_all_on_stream``).

Work enqueued on ``stream`` after the call starts only once every rank of ``group`` has
reached the barrier on its own stream, and sees every write that the ranks' streams made
before it (peer writes included).  The host returns at once.

How: one one-block kernel per call (written with the tilescale-lang intrinsics).  Each group
keeps a tiny symmetric heap of its own with one ``uint64`` slot per rank; call ``k`` on every
rank stores ``k`` into its slot on every peer (``st.release.sys``) and waits until every slot
of its own copy reached ``k`` (``ld.acquire.sys``).  Epochs only grow, so repeated and
back-to-back barriers need no reset.  The first call on a group is collective and slow (the
heap is made and the kernel compiled or loaded from TileLang's cache); later calls are one
kernel launch.  With ``TILESCALE_WAIT_TIMEOUT_MS`` set (compile time), a rank that never
arrives makes the others' kernels print the rank and slot they waited on and trap, instead
of hanging the stream.

Needs tilescale-lang (the kernel) and an initialised ``torch.distributed`` group; without
one (a single process) the call does nothing.  :func:`close_stream_barriers` frees the
heaps (collective, before the process group is destroyed).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["barrier_all_on_stream", "close_stream_barriers", "MAX_RANKS"]

#: Ranks a stream barrier supports (one uint64 slot each in its heap).
MAX_RANKS = 1022
_HEAP_BYTES = 1 << 21
_state: dict[Any, _StreamBarrier] = {}
_lock = threading.Lock()
_kernel_cache: dict[str, Any] = {}


def _kernel():
    """The barrier kernel (compiled once per process; TileLang's disk cache across ranks)."""
    if "k" not in _kernel_cache:
        import tilelang
        import tilelang.language as T

        @T.prim_func
        def tilescale_barrier_all(Slots: T.Tensor((MAX_RANKS,), "uint64"), epoch: T.int64):
            with T.Kernel(1, threads=128) as _:
                tx = T.get_thread_binding()
                n = T.get_num_ranks()
                me = T.get_rank()
                for i in T.serial(T.ceildiv(n, 128)):
                    if i * 128 + tx < n:
                        T.st(Slots[me], epoch, scope="sys", sem="release", dst_pe=i * 128 + tx)
                for i in T.serial(T.ceildiv(n, 128)):
                    if i * 128 + tx < n:
                        T.wait_ge(Slots[i * 128 + tx], epoch)

        _kernel_cache["k"] = tilelang.compile(tilescale_barrier_all, compile_once=True)
    return _kernel_cache["k"]


class _StreamBarrier:
    """One group's heap, slots and epoch counter."""

    def __init__(self, group: Any, rank: int, size: int):
        import tilelang
        import torch

        if size > MAX_RANKS:
            raise ValueError(f"barrier_all_on_stream supports at most {MAX_RANKS} ranks, the group has {size}")
        device = torch.device("cuda", torch.cuda.current_device())
        self.allocator = tilelang.get_allocator(
            size=_HEAP_BYTES, device=device, is_distributed=True, local_rank=rank, num_local_ranks=size, group=group
        )
        self.slots = tilelang.tensor((MAX_RANKS,), torch.uint64, allocator=self.allocator)
        self.slots.zero_()
        torch.cuda.synchronize(device)
        self.allocator._comm.barrier()  # every rank's slots are zero before anyone signals
        self.kernel = _kernel()
        self.kernel.initialize(allocator=self.allocator)
        self.device = device
        self.epoch = 0

    def launch(self, stream) -> None:
        import torch

        self.epoch += 1
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            self.kernel(self.slots, self.epoch)


def _resolve(stream, group):
    import torch
    import torch.distributed as dist

    if stream is not None and not (hasattr(stream, "cuda_stream") and hasattr(stream, "device")):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised")
        return None, None
    group = dist.group.WORLD if group is None else group
    stream = torch.cuda.current_stream() if stream is None else stream
    if torch.device(stream.device).index != torch.cuda.current_device():
        raise ValueError(f"stream is on {stream.device}, but the current device is cuda:{torch.cuda.current_device()}")
    return stream, group


def barrier_all_on_stream(stream=None, group=None) -> None:
    """Enqueue a barrier across the ranks of ``group`` on ``stream``; returns at once.

    Args:
        stream: a ``torch.cuda.Stream`` on the current device; default its current stream.
        group: a ``torch.distributed`` process group (default: the world group).  Every rank
            of the group calls this the same number of times, in the same order.

    Raises:
        TypeError: ``stream`` is not a CUDA stream.
        ValueError: ``stream`` is on another device; ``group`` without torch.distributed.
    """
    stream, group = _resolve(stream, group)
    if group is None:
        return  # a single process: nothing to wait for
    import torch.distributed as dist

    with _lock:
        barrier = _state.get(group)
        if barrier is None:
            barrier = _state[group] = _StreamBarrier(group, dist.get_rank(group), dist.get_world_size(group))
    barrier.launch(stream)


def close_stream_barriers() -> None:
    """Free the heaps of every group's stream barrier (collective over each group, in the
    order the groups first used :func:`barrier_all_on_stream`)."""
    with _lock:
        items = list(_state.items())
        _state.clear()
    import torch

    for _, barrier in items:
        torch.cuda.synchronize(barrier.device)
        barrier.allocator.close()
