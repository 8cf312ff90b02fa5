"""What the sequence-parallel attention ops share: :class:`AttentionOp`, the checks and outputs
of a call ``(q, k, v, *, out=None, lse=None)``."""

from typing import Optional, Tuple

import torch

from tilescale_examples.base import SymmetricOp, check_disjoint, check_tensor

__all__ = ["AttentionOp"]


class AttentionOp(SymmetricOp):
    """Base of :class:`~tilescale_examples.sequence.flash_decode.SPFlashDecode` and
    :class:`~tilescale_examples.sequence.sp_attention.SPAllGatherAttention`: subclasses set
    ``q_shape``, ``kv_shape`` (this rank's K/V shard), ``output`` and ``lse`` (the default
    outputs) and the shapes' names in messages."""

    #: How messages name the shapes of ``q``, of a K/V shard and of ``lse``.
    Q_SHAPE_NAME, KV_SHAPE_NAME, LSE_SHAPE_NAME = "the query shape", "the K/V shard shape", "the lse shape"

    def _begin_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Optional[torch.Tensor],
                    lse: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Check a call's arguments (``TypeError`` / ``ValueError`` naming the argument,
        :class:`~tilescale_examples.base.ClosedError` after ``close()``; ``out`` and ``lse``
        must not overlap ``q``, ``k``, ``v`` or each other: kernels read the inputs after
        others have written outputs), note a CUDA graph capture, count the call; returns where
        the call writes: ``(out, lse)``, default the op's own."""
        self._check_open()
        name = type(self).__name__
        check_tensor(q, self.q_shape, self.dtype, self.device, "q", self.Q_SHAPE_NAME, name)
        check_tensor(k, self.kv_shape, self.dtype, self.device, "k", self.KV_SHAPE_NAME, name)
        check_tensor(v, self.kv_shape, self.dtype, self.device, "v", self.KV_SHAPE_NAME, name)
        if out is not None:
            self._check_out(out, self.output.shape)
        if lse is not None:
            check_tensor(lse, self.lse.shape, torch.float32, self.device, "lse", self.LSE_SHAPE_NAME, name)
        check_disjoint({"out": out, "lse": lse}, {"q": q, "k": k, "v": v},
                       "the attention kernels read the inputs after other blocks have written the outputs; pass "
                       "separate tensors")
        self._note_capture()
        self.epoch += 1
        return (self.output if out is None else out), (self.lse if lse is None else lse)
