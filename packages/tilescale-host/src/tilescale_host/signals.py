"""Host-enqueued stream signals: ``set_signal`` and ``stream_wait_eq`` (alias ``wait_eq``).

Both enqueue a CUDA driver stream memory operation on a stream and return immediately:

* :func:`set_signal` enqueues ``cuStreamWriteValue32``: when the stream reaches it, the first
  element of an int32/uint32 tensor becomes ``value``;
* :func:`stream_wait_eq` enqueues ``cuStreamWaitValue32`` (or ``cuStreamWaitValue64`` with
  ``require_i64=True``): work enqueued later on the stream waits until the first element
  equals ``value``.  The host never blocks: the *stream* waits.  ``wait_eq``, the name the
  TileScale API reference gives it (``tilelang.distributed.wait_eq``), is the same function;
  it is not the device-side spin ``T.wait_eq`` that a kernel runs.

The signal tensor may live in peer-visible memory (an allocator-backed tensor), so a wait on
one GPU can be released by a set on another.  Every argument is checked before a raw device
address or stream handle is passed to the driver: the value range, the tensor's type, dtype,
emptiness and contiguity (checks that also work on CPU tensors), then that it is a CUDA
tensor, then that an explicit stream is on the tensor's device.
"""

from __future__ import annotations

import operator
import time
from typing import TYPE_CHECKING

from . import _cuda

if TYPE_CHECKING:
    import torch

__all__ = ["set_signal", "stream_wait_eq", "wait_eq", "synchronize_streams"]


def _dtypes(bits: int) -> tuple:
    import torch

    return (torch.int32, torch.uint32) if bits == 32 else (torch.int64, torch.uint64)


def check_signal_value(value, bits: int) -> int:
    """Return ``value`` as an int in ``[0, 2**bits)``; TypeError/ValueError otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"signal value must be an integer, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"signal value must be an integer, got {type(value).__name__}") from None
    if not 0 <= value < 1 << bits:
        raise ValueError(f"signal value {value} does not fit in an unsigned {bits}-bit integer")
    return value


def check_signal_tensor(tensor, bits: int) -> None:
    """Check type, dtype (int/uint of ``bits``), non-emptiness and contiguity of ``tensor``.

    These checks do not look at the device, so they are testable with CPU tensors; the
    CUDA check is :func:`check_cuda_tensor`.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"signal tensor must be a torch.Tensor, got {type(tensor).__name__}")
    allowed = _dtypes(bits)
    if tensor.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        hint = "" if bits == 64 else "; pass require_i64=True to wait_eq for 64-bit signals"
        raise TypeError(f"signal tensor dtype must be {names}, got {tensor.dtype}{hint}")
    if tensor.numel() == 0:
        raise ValueError("signal tensor must be nonempty")
    if not tensor.is_contiguous():
        raise ValueError("signal tensor must be contiguous")


def check_cuda_tensor(tensor) -> None:
    """Raise ValueError unless ``tensor`` lives on a CUDA device."""
    if not tensor.is_cuda:
        raise ValueError(f"signal tensor must be a CUDA tensor, got device {tensor.device}")


def resolve_stream(tensor, stream):
    """Return ``stream`` (default: the tensor's device's current stream) after checking its device."""
    import torch

    if stream is None:
        return torch.cuda.current_stream(tensor.device)
    if not hasattr(stream, "cuda_stream") or not hasattr(stream, "device"):
        raise TypeError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
    stream_device = torch.device(stream.device)
    if stream_device.type != "cuda" or stream_device.index != tensor.device.index:
        raise ValueError(f"stream is on {stream_device} but the signal tensor is on {tensor.device}")
    return stream


def _checked(tensor, value, stream, bits: int):
    """All checks, in order; returns ``(value, stream)`` ready for the driver."""
    value = check_signal_value(value, bits)
    check_signal_tensor(tensor, bits)
    check_cuda_tensor(tensor)
    return value, resolve_stream(tensor, stream)


def set_signal(tensor: torch.Tensor, value: int, stream: torch.cuda.Stream | None = None) -> None:
    """Enqueue ``tensor[0] = value`` (cuStreamWriteValue32) on ``stream``.

    Args:
        tensor: nonempty contiguous int32 or uint32 CUDA tensor; its first element is written.
        value: unsigned 32-bit value, ``0 <= value < 2**32`` (stored bit-for-bit in int32).
        stream: a ``torch.cuda.Stream`` on the tensor's device; default its current stream.
    """
    value, stream = _checked(tensor, value, stream, 32)
    drv = _cuda.driver()
    _cuda.check(
        drv.cuStreamWriteValue32(
            stream.cuda_stream,
            tensor.data_ptr(),
            value,
            drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
        ),
        "cuStreamWriteValue32",
    )


def stream_wait_eq(
    tensor: torch.Tensor,
    value: int,
    stream: torch.cuda.Stream | None = None,
    require_i64: bool = False,
) -> None:
    """Make ``stream`` wait until ``tensor[0] == value`` (cuStreamWaitValue32/64).

    Args:
        tensor: nonempty contiguous CUDA tensor: int32/uint32, or int64/uint64 with
            ``require_i64=True``; its first element is polled.
        value: unsigned 32-bit value (unsigned 64-bit with ``require_i64=True``).
        stream: a ``torch.cuda.Stream`` on the tensor's device; default its current stream.
        require_i64: compare 64 bits with cuStreamWaitValue64.

    Enqueues the wait and returns at once (the host does not wait). ``wait_eq`` is the same
    function; the device-side spin of a kernel is ``T.wait_eq``.
    """
    bits = 64 if require_i64 else 32
    value, stream = _checked(tensor, value, stream, bits)
    drv = _cuda.driver()
    wait = drv.cuStreamWaitValue64 if require_i64 else drv.cuStreamWaitValue32
    _cuda.check(
        wait(
            stream.cuda_stream,
            tensor.data_ptr(),
            value,
            drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ,
        ),
        f"cuStreamWaitValue{bits}",
    )


#: The TileScale API reference's name of :func:`stream_wait_eq` (a host-enqueued *stream* wait;
#: not the device-side ``T.wait_eq``).
wait_eq = stream_wait_eq


def synchronize_streams(streams, timeout: float = 60.0, poll_interval: float = 1e-3) -> None:
    """Wait until every stream in ``streams`` is idle, or raise TimeoutError after ``timeout`` s.

    Unlike ``stream.synchronize()``, which blocks inside the driver for as long as a
    ``wait_eq`` is unsatisfied, this polls ``stream.query()`` so a signal that never comes
    ends in a Python error naming the streams still busy.

    Hazard worth knowing: two streams may share one hardware queue, so a wait enqueued before
    the work that releases it, on another stream, can block that work forever. Enqueue the
    producer's work first, or give each stream its own queue (``CUDA_DEVICE_MAX_CONNECTIONS``).

    Args:
        streams: iterable of ``torch.cuda.Stream``.
        timeout: seconds to wait in total, > 0.
        poll_interval: seconds between polls.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    pending = list(streams)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [s for s in pending if not s.query()]
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"stream 0x{s.cuda_stream:x} on {s.device}" for s in pending)
            raise TimeoutError(
                f"{names} still busy after {timeout:g} s: a wait_eq whose signal never came?"
            )
        time.sleep(poll_interval)
