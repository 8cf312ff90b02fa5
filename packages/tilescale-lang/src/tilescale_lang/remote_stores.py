"""Lower 16-byte vector stores into remote views to one ``st.global.v4.b32`` each.

A remote ``T.copy(..., dst_pe=p)`` (:mod:`.peer_copy`) writes through a view whose data
pointer is ``tilescale::remap_ptr(buf, p)``, an address computed from integers. When the
stored value comes from registers (a ``T.alloc_local`` fragment filled piece by piece, like a
reduction's result), nvcc splits the plain 16-byte assignment that stock TileLang prints for a
vectorised store into four 4-byte stores (``st.u32``): four times the store instructions and
partial-sector writes, which over NVLink are separate small transactions.

:func:`lower_remote_vector_stores` rewrites every such store, a ``BufferStore`` into a buffer
whose data variable is bound to ``tilescale::remap_ptr`` with one contiguous (stride-1
``Ramp``) index of 128 bits in all (8 x 16-bit, 4 x 32-bit, 2 x 64-bit elements), into a
call of ``tilescale::store_vec16(address, value)`` (``include/tilescale/memory.cuh``): one
``st.global.v4.b32``. Remote views are always of global buffers (:func:`.peer_copy.global_buffer`)
and a vectorised store is 16-byte aligned (stock TileLang prints it as a ``uint4`` access),
so the instruction has the same requirements as the store it replaces. Stores of other widths,
local stores and loads are left as they are. It runs after stock TileLang's
``LowerLDGSTG`` (:mod:`.pipeline_hooks`), on kernels that call ``tilescale::`` helpers.
"""

from __future__ import annotations

from ._tvm import tirx

__all__ = ["STORE_HELPER", "REMAP_HELPER", "VECTOR_BITS", "remote_data_vars", "lower_remote_vector_stores"]

#: Device helper a remote 16-byte store becomes.
STORE_HELPER = "tilescale::store_vec16"
#: Device helper whose result marks a remote view's data pointer.
REMAP_HELPER = "tilescale::remap_ptr"
#: Width of the stores rewritten (bits).
VECTOR_BITS = 128


def _is_remap_call(value) -> bool:
    return (isinstance(value, tirx.Call) and value.op.name == "tirx.call_extern" and len(value.args) >= 1
            and isinstance(value.args[0], tirx.StringImm) and value.args[0].value == REMAP_HELPER)


def remote_data_vars(body) -> list:
    """Variables of ``body`` bound to a ``tilescale::remap_ptr`` call (remote views' data)."""
    found = []

    def visit(node):
        if isinstance(node, tirx.Bind) and _is_remap_call(node.value):
            found.append(node.var)

    tirx.stmt_functor.post_order_visit(body, visit)
    return found


def _contiguous_128(store) -> bool:
    if len(store.indices) != 1 or not isinstance(store.indices[0], tirx.Ramp):
        return False
    ramp, dtype = store.indices[0], store.value.dtype
    stride = ramp.stride
    return (isinstance(stride, tirx.IntImm) and stride.value == 1 and dtype.lanes > 1
            and dtype.lanes * dtype.bits == VECTOR_BITS)


def lower_remote_vector_stores(func):
    """``func`` (a ``PrimFunc``) with its 16-byte stores into remote views lowered to
    :data:`STORE_HELPER` calls (see the module docstring); unchanged when it has none."""
    remote = remote_data_vars(func.body)
    if not remote:
        return func

    def postorder(node):
        if (isinstance(node, tirx.BufferStore) and any(node.buffer.data.same_as(v) for v in remote)
                and _contiguous_128(node)):
            address = tirx.address_of(tirx.BufferLoad(node.buffer, [node.indices[0].base]))
            return tirx.Evaluate(tirx.call_extern("handle", STORE_HELPER, address, node.value))
        return None

    body = tirx.stmt_functor.ir_transform(func.body, None, postorder, ["tirx.BufferStore"])
    return func.with_body(body)
