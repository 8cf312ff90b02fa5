"""Small host-side steps over a process group that the ops share: the end of a constructor
(:func:`settle`), where a group's tensors live (:func:`collective_device`) and an agreement
of every rank (:func:`all_ranks_agree`). Re-exported by :mod:`tilescale_examples.base`."""

from __future__ import annotations

import torch

__all__ = ["settle", "collective_device", "all_ranks_agree"]


def settle(device, group=None) -> None:
    """End of a collective constructor: wait for the device (flags zeroed, tables copied),
    then barrier over ``group`` so that no peer signals a flag before its owner zeroed it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        import torch.distributed as dist

        dist.barrier(group=group)


def collective_device(group, device) -> torch.device:
    """Where small host-side collectives over ``group`` (flags, timings, agreements) put
    their tensors: ``device`` under NCCL, the CPU otherwise (gloo takes host tensors)."""
    import torch.distributed as dist

    return torch.device(device) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_ranks_agree(ok: bool, group=None, device=None) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a MIN all-reduce; ``ok`` itself
    without a group). Collective: every rank of ``group`` must call it."""
    if group is None:
        return bool(ok)
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device(group, device))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
