"""The lean launcher's driver entry points (:mod:`tilescale_lang.lean`): ``cuLaunchKernel``,
``cuLaunchCooperativeKernel`` and ``cuStreamIsCapturing`` found once through cuda-bindings'
``cuGetProcAddress`` and called through ctypes, and the current torch stream's handle."""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p)
_COOPERATIVE_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p,
                                       ctypes.c_void_p)
_calls: tuple | None = None


def _with_no_extra(launch, fn, gx, gy, gz, bx, by, bz, smem, stream, params):
    return launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, None)


def _driver_calls() -> tuple:
    """``(launch, cooperative_launch)``: each ``(function, gx, gy, gz, bx, by, bz,
    shared_bytes, stream, params_address) -> CUresult`` (ints in, an int out).

    The driver's ``cuLaunchKernel`` and ``cuLaunchCooperativeKernel`` entry points, found
    through cuda-bindings' ``cuGetProcAddress`` and called through ctypes (a few hundred
    nanoseconds, where a cuda-bindings call converts eleven Python arguments); cuda-bindings'
    own calls when the driver does not give them. Their addresses are
    :func:`_driver_addresses`'.
    """
    global _calls, _addresses
    if _calls is None:
        from tilescale_core import driver

        drv = driver.driver_module()
        found, addresses = [], []
        for name, prototype in (("cuLaunchKernel", _LAUNCH), ("cuLaunchCooperativeKernel", _COOPERATIVE_LAUNCH)):
            address = _proc_address(name)
            found.append(prototype(address) if address else None)
            addresses.append(address)
        if found[0] is not None:
            launch = functools.partial(_with_no_extra, found[0])
        else:
            def launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params):
                return int(drv.cuLaunchKernel(drv.CUfunction(fn), gx, gy, gz, bx, by, bz, smem, drv.CUstream(stream),
                                              params, 0)[0])
        if found[1] is not None:
            cooperative = found[1]
        else:
            def cooperative(fn, gx, gy, gz, bx, by, bz, smem, stream, params):
                return int(drv.cuLaunchCooperativeKernel(drv.CUfunction(fn), gx, gy, gz, bx, by, bz, smem,
                                                         drv.CUstream(stream), params)[0])
        _calls, _addresses = (launch, cooperative), tuple(addresses)
    return _calls


def _driver_addresses() -> tuple:
    """``(cuLaunchKernel, cuLaunchCooperativeKernel)``: the driver entry points' addresses
    (ints), each None where the driver does not give it."""
    _driver_calls()
    return _addresses


_addresses: tuple = (None, None)


def _current_stream_getter() -> Callable[[int], int]:
    """``(device_index) -> handle`` of the current torch stream: torch's own (what its
    launchers use), found once."""
    global _stream_getter
    if _stream_getter is None:
        import torch

        getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _stream_getter = getter or (lambda index: torch.cuda.current_stream(index).cuda_stream)
    return _stream_getter


_stream_getter: Any = None


def _proc_address(name: str) -> int | None:
    """The address of the driver entry point ``name`` (through cuda-bindings'
    ``cuGetProcAddress``), or None where the driver does not give it."""
    from tilescale_core import driver

    try:
        flags = driver.driver_module().CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        address = driver.call("cuGetProcAddress", name.encode(), driver.driver_version(), flags)
        return int(address[0] if isinstance(address, tuple) else address) or None
    except (driver.CudaError, AttributeError, TypeError, ValueError):
        return None


def _capture_query_address() -> int | None:
    """The address of the driver's ``cuStreamIsCapturing``, or None where the driver does not
    give it (:func:`_proc_address`); found once."""
    global _capture_query
    if _capture_query is None:
        _capture_query = _proc_address("cuStreamIsCapturing") or 0
    return _capture_query or None


_capture_query: Any = None
