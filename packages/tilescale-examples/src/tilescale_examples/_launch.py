"""How the ops launch their kernels: through a lean launcher (:mod:`tilescale_lang.lean`) per
kernel, prepared at the first call; and how they launch their last call again for a call
whose tensors are laid out as its (:class:`Relaunching`: such a call passes every check that
call made, so it launches the same parameters, its tensors' addresses aside; see
docs/launch.md, "Repeated calls")."""

from __future__ import annotations

import logging
from operator import is_
from typing import Any, Sequence

import torch

__all__ = ["launch", "prepared_launch", "kept_view", "table_bound", "KeptLaunch", "Relaunching"]

log = logging.getLogger("tilescale_examples.launch")

#: Attributes of a compiled kernel that the table binding of
#: :meth:`~tilescale_examples.base.SymmetricOp.bind_table` keeps: the ids of the allocators that
#: bound it, whether every launch must rebind (a CUDA graph captured table copies), the allocator
#: a graph captured it for unbound.
_USERS, _REBIND, _PINNED = "_tilescale_table_users", "_tilescale_always_rebind", "_tilescale_pinned_to"


def table_bound(op: Any, state: dict) -> bool:
    """Whether the compiled kernel whose ``__dict__`` is ``state`` has ``op``'s allocator's
    metadata table bound, with no CUDA graph having made every launch rebind: the eager
    launch needs no table copy (the first test of
    :meth:`~tilescale_examples.base.SymmetricOp.bind_table`, outside a capture)."""
    return state.get(op._TABLE_OWNER) is op.allocator and not state.get(_REBIND)


#: Prepared launchers an instance keeps at most (one per kernel it launches).
MAX_PREPARED = 8


def _key(value: Any) -> Any:
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _sized_key(value: Any) -> Any:
    return (value.data_ptr(), value.shape) if isinstance(value, torch.Tensor) else value


def launch(prepared: dict, kernel: Any, args: tuple, changing: Sequence[int]) -> None:
    """Launch ``kernel`` with ``args`` (every parameter, in order) on the current stream.

    ``prepared`` is the calling instance's cache. A launcher is prepared (one full check of
    every argument) at the first call; later calls pack only the ``changing`` arguments (their
    symbolic sizes may change from call to call; their dtype, contiguity and device are the
    calling op's checks: :meth:`~tilescale_lang.lean.LeanLaunch.trusted`), after checking that
    every other argument is the prepared one (the same object, or a tensor with the same
    address, and shape where it sizes the kernel; a scalar's value); when one is not, the
    launcher is prepared again. Until the kernel's module is
    loaded (its first launch) the call goes through TileLang's launcher, and so does every
    call of a kernel that is not a ``tvm_ffi`` JITKernel (another execution backend, or a
    test's stand-in).
    """
    if getattr(kernel, "execution_backend", None) != "tvm_ffi":
        kernel(*args)
        return
    entry = prepared.get(id(kernel))
    if entry is not None and (entry[0].kernel is not kernel or not (
            all(map(is_, map(args.__getitem__, entry[1]), entry[2]))  # the same objects (C-level loops)
            or all(key(args[i]) == fixed for i, key, fixed in entry[3]))):
        entry = None
    if entry is None:
        from tilescale_lang.lean import prepare  # here: the steady-state call pays no import statement

        if len(prepared) >= MAX_PREPARED:
            prepared.clear()
        lean = prepare(kernel, args, changing)
        fixed = [i for i in range(len(args)) if i not in lean.positions]
        keys = [(i, _sized_key if i in lean.sized_positions else _key) for i in fixed]
        entry = prepared[id(kernel)] = (lean, fixed, [args[i] for i in fixed],
                                        [(i, key, key(args[i])) for i, key in keys])
    entry[0].trusted(*map(args.__getitem__, changing))  # the op checked its tensors before


def prepared_launch(prepared: dict, kernel: Any):
    """The lean launcher (:class:`~tilescale_lang.lean.LeanLaunch`) that :func:`launch`
    prepared for ``kernel`` in the instance cache ``prepared``; ``KeyError`` naming the kernel
    when none was (no call yet, or not a ``tvm_ffi`` kernel)."""
    entry = prepared.get(id(kernel))
    if entry is None:
        raise KeyError(f"no lean launcher prepared for kernel {getattr(kernel, 'name', kernel)!r}: call the op once "
                       "with lean_launch = True first")
    return entry[0]


def kept_view(op: Any, attr: str, tensor: torch.Tensor, make) -> Any:
    """``make(tensor)`` (a view an op's kernel takes), kept in ``op``'s attribute ``attr`` for
    the next call that passes the same tensor (the same object at the same address): building
    a view costs host time at every call. The op lists ``attr`` in its ``_BUFFERS``
    (``close()`` drops it)."""
    kept = op.__dict__.get(attr)
    if kept is not None and kept[0] is tensor and kept[1] == tensor.data_ptr():
        return kept[2]
    view = make(tensor)
    setattr(op, attr, (tensor, tensor.data_ptr(), view))
    return view


def _freeze(op: Any, kernel: Any, args: tuple, moving: Sequence[int]) -> Any:
    """``kernel``'s launch with ``args`` as a :class:`~tilescale_lang.lean.FrozenLaunch` whose
    parameters at the positions ``moving`` may get new addresses (made after a launch of
    them: the kernel's module is loaded), or False where none can be made (not a ``tvm_ffi``
    kernel, ...: :func:`~tilescale_lang.lean.freeze`; logged once per kernel when freezing
    fails: the repeated calls then take the launcher)."""
    from tilescale_lang import lean  # here: the steady-state call pays no import statement

    try:
        return lean.freeze(kernel, args, moving) or False
    except Exception as exc:  # an optimisation only: the launcher path stays correct
        name = getattr(kernel, "name", type(kernel).__name__)
        if name not in _NOT_FROZEN:
            _NOT_FROZEN.add(name)
            log.info("%s: repeated calls of kernel %s take the launcher (no frozen launch: %s)", type(op).__name__,
                     name, exc)
        return False


#: Kernels whose frozen launch failed (logged once each).
_NOT_FROZEN: set = set()


def _layout(t: torch.Tensor) -> tuple:
    """What a kept launch compares of a call's tensor: address, shape, strides, dtype, type
    (an object without them raises AttributeError or TypeError)."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, type(t)


class KeptLaunch:
    """The kernel launch of an op's last full call, for calls whose tensors are laid out as
    that call's (shape, strides, dtype, device, and address, or where :attr:`movable` another
    address the full call would treat alike): such a call passes every check the full call
    made, so it can launch ``args`` again with only the views of its tensors made anew.

    Args:
        tensors: the call's tensor arguments (their layouts are kept, never the tensors).
        args: every kernel parameter of the launch, in order.
        changing: the positions of ``args`` packed per call (the lean launcher's).
        views: ``(position in args, index in tensors)`` of each parameter that is a view of
            a call tensor (a view of the same shape is made of the new call's tensor);
            parameters not listed are launched as they are (the op's own buffers, or views
            the op holds, whose memory therefore cannot be another tensor's). The listed
            views are not kept, so the call's tensors' memory is free for the next ones.
        kernel: the kernel launched (None: the op's ``kernel``).
        movable: ``(first, last)``, the byte range of the op's own buffers, where the viewed
            tensors may be at other addresses than the kept call's (16-byte aligned, outside
            that range: every other check the full call made still holds); None: they must
            be at the kept addresses.
        plain: the kernel has no heap table to bind (a stock TileLang kernel: the GEMM of
            the overlapped GEMMs at one rank).
    """

    __slots__ = ("layouts", "devices", "args", "changing", "views", "viewed", "frozen", "cuda",
                 "kernel", "movable", "plain")

    def __init__(self, tensors, args: tuple, changing: Sequence[int], views: Sequence[tuple] = (), kernel=None,
                 movable: tuple | None = None, plain: bool = False):
        self.layouts = [_layout(t) for t in tensors]
        self.devices = [t.device for t in tensors]
        self.cuda = tensors[0].device.type == "cuda"  # where a call may be captured in a CUDA graph
        self.views = [(pos, index, args[pos].shape) for pos, index in views]
        self.viewed = frozenset(index for _, index in views)  # the tensors that may move
        kept = list(args)
        for pos, _, _ in self.views:
            kept[pos] = None  # the call's views are not kept: their memory may serve the next tensors
        self.args, self.changing, self.kernel, self.movable, self.plain = kept, changing, kernel, movable, plain
        #: The launch with every parameter fixed but the viewed tensors' addresses
        #: (:class:`~tilescale_lang.lean.FrozenLaunch`), made at the first repeated call; None
        #: before, False where none can be made.
        self.frozen = None

    def addresses_for(self, tensors) -> tuple | None:
        """For a call on ``tensors`` laid out as the last launched call's (type, shape,
        strides, dtype, address): ``()``, nothing to change; where :attr:`movable` and only
        viewed tensors moved (each to an aligned address outside the op's buffers, on the
        kept device: every check of the full call still holds), their new addresses, in the
        order of ``views``, which become the last launched call's (the caller launches them:
        its frozen launch then holds them); else None. At an unchanged address the device is
        the kept one too (one memory, one device: CUDA's unified addressing)."""
        kept = self.layouts
        try:  # _layout's fields compared one by one, cheapest first, stopping at the first that
            # differs: the steady-state call's test, with no tuple or list built (a list of three
            # layouts costs about 1 us more per call)
            if len(tensors) == len(kept):
                for t, k in zip(tensors, kept):
                    if (type(t) is not k[4] or t.data_ptr() != k[0] or t.dtype is not k[3] or t.shape != k[1]
                            or t.stride() != k[2]):
                        break
                else:
                    return ()
            layouts = [(t.data_ptr(), t.shape, t.stride(), t.dtype, type(t)) for t in tensors]
        except (AttributeError, TypeError):  # not a tensor
            return None
        moving = self.movable
        if moving is None or len(layouts) != len(self.layouts):
            return None
        for i, (t, new, old, device) in enumerate(zip(tensors, layouts, self.layouts, self.devices)):
            address = new[0]
            if new[1:] != old[1:] or address != old[0] and (
                    address % 16 or i not in self.viewed or t.device != device
                    or moving[0] < address + t.numel() * t.element_size() and address < moving[1]):
                return None
        self.layouts = layouts
        return tuple(layouts[index][0] for _, index, _ in self.views)

    def moving(self) -> list:
        """The positions of ``args`` whose addresses a repeated call may change (the views of
        the call's tensors where :attr:`movable`; none where they must stay where they were:
        its frozen launch then has every parameter fixed)."""
        return [pos for pos, _, _ in self.views] if self.movable is not None else []

    def args_for(self, tensors) -> tuple:
        """The launch's parameters for a call on ``tensors`` (for which :meth:`addresses_for`
        gave addresses): new views of them where the kept call had views of its tensors."""
        args = self.args.copy()
        for pos, index, shape in self.views:
            args[pos] = tensors[index].view(*shape)  # view(*ints): cheaper than view(torch.Size)
        return tuple(args)


class Relaunching:
    """The repeated-call path of :class:`~tilescale_examples.base.SymmetricOp`: an op keeps
    the launch of a full call (:meth:`_keep_launch`, after its own conditions) and starts each
    call with :meth:`_relaunch`. An op with several calls keeps one launch per call site: an
    attribute named in :attr:`_RELAUNCH_SITES` (the default ``_kept_launch``), the key of its
    last full call (:meth:`_keep_launch`) in that name + ``_key``. Needs the op's ``kernel``,
    ``allocator``, ``epoch``, ``_captured``, ``_TABLE_OWNER``, ``_check_open()``,
    ``bind_table()`` and ``_launch_kernel()``; ``close()`` sets the sites' attributes to None."""

    #: The attributes holding each call site's kept launch (:class:`KeptLaunch`, or None).
    _RELAUNCH_SITES = ("_kept_launch",)
    #: The last full call's launch (:class:`KeptLaunch`) that :meth:`_relaunch` repeats, or None.
    _kept_launch = None

    def _relaunch(self, *tensors, site: str = "_kept_launch") -> bool:
        """Launch the kernel of the launch kept at ``site`` (:meth:`_keep_launch`) when
        ``tensors`` are laid out as that call's (:meth:`KeptLaunch.addresses_for`: the same
        shapes, strides, dtypes, devices and addresses, or moved where the kept launch allows
        it: every check it made holds) and nothing since needs the full call:
        no CUDA graph capture now or before, the op and its allocator open (else
        :class:`~tilescale_examples.base.ClosedError`). Counts the call (``epoch``) at the
        default site; an op counts its other sites' calls itself. Returns whether it
        launched; False leaves everything to the full call.

        The steady state of a loop calling an op on the same buffers, or on fresh tensors of
        one layout: its host time is a few comparisons per tensor and one launch. Every
        parameter of such a call is the kept call's but the moved tensors' addresses, so from
        the second repeated call on it launches a :class:`~tilescale_lang.lean.FrozenLaunch`
        made at the first, the addresses that moved written into it (one call of the launch records' C
        helper, no argument packed or checked again, which also asks the driver whether the
        stream is capturing a CUDA graph and then launches nothing; where none can be made,
        the op's launcher with new views of the tensors)."""
        kept = getattr(self, site)
        if kept is None or self._captured:  # close() forgets the kept launches
            return False
        addresses = kept.addresses_for(tensors)
        if addresses is None:
            return False
        if self.allocator.closed:
            self._check_open()  # raises
        kernel = self.kernel if kept.kernel is None else kept.kernel
        frozen = kept.frozen
        if frozen and (kept.plain or table_bound(self, kernel.__dict__)):
            if not frozen(*addresses):  # the stream is capturing a CUDA graph: nothing launched
                return False
        elif not self._relaunch_through_launcher(kept, kernel, tensors, addresses):
            return False
        if site == "_kept_launch":
            self.epoch += 1
        return True

    def _relaunch_through_launcher(self, kept: KeptLaunch, kernel: Any, tensors, addresses: tuple) -> bool:
        """:meth:`_relaunch`'s launch where it is not its frozen launch alone: none frozen
        yet (the first repeated call, which freezes this launch) or none can be, or the
        table to bind first. Returns False, with nothing launched, while a CUDA graph is
        being captured."""
        if kept.cuda and torch.cuda.is_current_stream_capturing():
            if addresses:  # moved (addresses_for kept the new layout), not written into the frozen launch
                kept.frozen = None
            return False
        if not kept.plain and not table_bound(self, kernel.__dict__):  # not capturing (tested above)
            self.bind_table(kernel=kernel)
        frozen = kept.frozen
        if frozen:
            return frozen(*addresses)
        args = kept.args_for(tensors)
        self._launch_kernel(args, kept.changing, kernel=kernel)
        if frozen is None:
            kept.frozen = _freeze(self, kernel, args, kept.moving())
        return True

    #: The key of the last full call that :meth:`_keep_launch` could keep at the default site
    #: (its first tensor's address, or shape and dtype where the launch may move), or None.
    _kept_launch_key = None

    def _keep_launch(self, keep: bool, tensors, args: tuple, changing: Sequence[int], views=(),
                     outside: tuple | None = None, site: str = "_kept_launch", kernel=None,
                     movable: bool = False, plain: bool = False) -> None:
        """Keep this full call's launch of ``kernel`` (None: the op's ``kernel``) at ``site``
        for :meth:`_relaunch` when ``keep`` (the op's condition: the launch depends on the
        call's ``tensors`` only through ``views``, see :class:`KeptLaunch`), no call was
        captured, the last full call had the same key (its first tensor at the same address:
        a loop over one buffer, whose next call is likely laid out as this one; a loop over
        new tensors at new addresses pays nothing more than this comparison) and the first
        tensor's bytes lie
        ``outside`` the op's ``(first, last)`` byte range (its own buffers, which a full call
        treats otherwise) when given; else forget the kept launch. ``movable``: later calls
        may pass the viewed tensors at other addresses (aligned, outside ``outside`` when
        given: see :class:`KeptLaunch`), so the key is the first tensor's shape and dtype: the
        launch is kept after two calls in a row on tensors of one layout, wherever they
        were. ``plain``: the kernel has no heap table (:class:`KeptLaunch`)."""
        first = tensors[0]
        address = first.data_ptr() if keep and not self._captured else None
        key = address if address is None or not movable else (first.shape, first.dtype)
        if address is None or key != getattr(self, site + "_key", None):
            setattr(self, site + "_key", key)
            setattr(self, site, None)
            return
        if outside is not None:
            end = address + first.numel() * first.element_size()
            if end > outside[0] and address < outside[1]:
                setattr(self, site, None)
                return
        moves = (outside if outside is not None else (0, 0)) if movable else None  # (0, 0): no own bytes to avoid
        setattr(self, site, KeptLaunch(tensors, args, changing, views, kernel, moves, plain))

    def _forget_launches(self) -> None:
        """Forget every site's kept launch (``close()``)."""
        for site in self._RELAUNCH_SITES:
            setattr(self, site, None)
            setattr(self, site + "_key", None)
