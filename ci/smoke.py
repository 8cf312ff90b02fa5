"""Smoke test of one installed part (``nox -s install-parts``): imports, then a CPU lowering.

``python ci/smoke.py lang|host|meta|examples``
"""

import sys

part = sys.argv[1]
import tilelang  # noqa: E402  (the hook attaches every installed TileScale wheel)
import tilelang.language as T  # noqa: E402

assert callable(tilelang.get_allocator) and callable(tilelang.tensor), "tilescale-core did not attach"
if part in ("host", "meta", "examples"):
    from tilelang.distributed.host import init_dist  # noqa: F401

    import tilescale_host

    assert callable(tilescale_host.do_bench)
if part == "host":  # no tilescale-lang: a stock kernel lowers
    @T.prim_func
    def k(A: T.Tensor((128,), "float32")):
        with T.Kernel(1, threads=128) as _:
            A[T.get_thread_binding()] = 1.0

    src = tilelang.lower(k, target={"kind": "cuda", "arch": "sm_90a"}).kernel_source
    assert "__global__" in src and "tilescale::" not in src
else:
    from tilescale_lang.codegen import cuda_source

    if part == "examples":
        from tilescale_examples.tutorials.ring_put import build_ring_put

        k = build_ring_put(1024)
    else:
        @T.prim_func
        def k(A: T.Tensor((128,), "float32"), B: T.Tensor((128,), "float32")):
            with T.Kernel(1, threads=128) as _:
                T.put_block(T.address_of(A[0]), T.address_of(B[0]), 128, dst_pe=(T.get_rank() + 1) % T.get_num_ranks())

    src = cuda_source(k)
    assert "tilescale::put_block<" in src, src[-2000:]
print(f"smoke {part}: imports and CPU lowering ok (tilelang {tilelang.__version__})")
