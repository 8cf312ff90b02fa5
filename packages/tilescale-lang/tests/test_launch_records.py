"""Launch records (tilescale_lang.launch_records): the C helper compiled with the machine's C
compiler launches an array of records through the driver entry points they name (here C
function pointers to recording Python functions), stops at the first failing launch and names
it; without a compiler it is not made and the lean launcher keeps its ctypes path (CPU)."""

import ctypes
import shutil

import pytest

from tilescale_lang import launch_records, lean_driver

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """No helper loaded yet in this process; the cache in ``tmp_path``."""
    monkeypatch.setattr(launch_records, "_helper", None)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    return tmp_path


class Driver:
    """cuLaunchKernel and cuLaunchCooperativeKernel as C function pointers recording their
    arguments; ``fail`` maps a function handle to the CUresult its launch returns."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail or {}
        self.launch = lean_driver._LAUNCH(lambda *a: self._record("launch", a))
        self.cooperative = lean_driver._COOPERATIVE_LAUNCH(lambda *a: self._record("cooperative", a))

    def _record(self, kind, args):
        fn, dims, smem, stream, params = args[0], args[1:7], args[7], args[8], args[9]
        self.calls.append((kind, fn, dims, smem, stream, params) + ((args[10],) if kind == "launch" else ()))
        return self.fail.get(fn, 0)

    def address(self, cooperative=False):
        return ctypes.cast(self.cooperative if cooperative else self.launch, ctypes.c_void_p).value


def _records(driver, specs):
    """Records of ``specs``: ``(function, dims, shared bytes, cooperative, params address)``."""
    records = launch_records.make_records(len(specs))
    for record, (fn, dims, smem, cooperative, params) in zip(records, specs):
        record.launch, record.function = driver.address(cooperative), fn
        record.dims[:] = dims
        record.shared_bytes, record.cooperative, record.params = smem, int(cooperative), params
    return records


@needs_cc
def test_the_helper_launches_every_record_in_order_on_the_stream(fresh):
    run = launch_records.helper()
    assert run is not None and launch_records.library_path().exists()
    assert launch_records.library_path().parent == fresh / "tilescale-launch"
    driver = Driver()
    specs = [(0x10, (3, 1, 1, 128, 1, 1), 0, False, 0x5000), (0x20, (132, 2, 1, 256, 1, 1), 49152, True, 0x6000),
             (0x30, (1, 1, 1, 32, 1, 1), 0, False, 0x7000)]
    records, failed = _records(driver, specs), ctypes.c_int(-1)
    assert run(ctypes.addressof(records), 3, 0x1234, ctypes.byref(failed)) == 0 and failed.value == -1
    assert driver.calls == [("launch", 0x10, (3, 1, 1, 128, 1, 1), 0, 0x1234, 0x5000, None),
                            ("cooperative", 0x20, (132, 2, 1, 256, 1, 1), 49152, 0x1234, 0x6000),
                            ("launch", 0x30, (1, 1, 1, 32, 1, 1), 0, 0x1234, 0x7000, None)]
    assert launch_records.helper() is run  # loaded once per process


@needs_cc
def test_the_first_failing_launch_stops_the_rest_and_is_named(fresh):
    run = launch_records.helper()
    driver = Driver(fail={0x20: 701})
    records = _records(driver, [(0x10, (1,) * 6, 0, False, 0), (0x20, (1,) * 6, 0, False, 0), (0x30, (1,) * 6, 0, False, 0)])
    failed = ctypes.c_int(-1)
    assert run(ctypes.addressof(records), 3, None, ctypes.byref(failed)) == 701
    assert failed.value == 1 and [c[1] for c in driver.calls] == [0x10, 0x20]


@needs_cc
def test_the_call_helper_launches_a_launch_call_unless_its_stream_is_capturing(fresh):
    """ts_launch_call_run: the records of a LaunchCall on its stream; with a capture query
    (cuStreamIsCapturing), nothing launched and CAPTURING returned while the query says the
    stream captures or fails (the caller then takes a path that knows about captures)."""
    call_run = launch_records.call_helper()
    assert call_run is not None and launch_records.helper() is not None
    driver = Driver(fail={0x30: 719})
    records = _records(driver, [(0x10, (2, 1, 1, 64, 1, 1), 0, False, 0x5000), (0x20, (1,) * 6, 128, True, 0x6000)])
    call = launch_records.LaunchCall(records=ctypes.addressof(records), n=2, failed=-1, stream=0x77)
    ref = ctypes.byref(call)
    assert call_run(ref) == 0 and call.failed == -1
    assert driver.calls == [("launch", 0x10, (2, 1, 1, 64, 1, 1), 0, 0x77, 0x5000, None),
                            ("cooperative", 0x20, (1,) * 6, 128, 0x77, 0x6000)]
    answers, asked = {0x77: (0, 0), 0x88: (0, 1), 0x99: (0, 2), 0xAA: (900, 0)}, []

    def is_capturing(stream, status):  # CUresult cuStreamIsCapturing(CUstream, CUstreamCaptureStatus *)
        asked.append(stream)
        err, state = answers[stream]
        status[0] = state
        return err

    query = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))(is_capturing)
    call.is_capturing = ctypes.cast(query, ctypes.c_void_p).value
    del driver.calls[:]
    assert call_run(ref) == 0 and len(driver.calls) == 2  # not capturing: launched
    for stream in (0x88, 0x99, 0xAA):  # active, invalidated, the query failed: nothing launched
        call.stream = stream
        assert call_run(ref) == launch_records.CAPTURING
    assert len(driver.calls) == 2 and asked == [0x77, 0x88, 0x99, 0xAA]
    records[1].function = 0x30  # a failing launch: its CUresult and index
    call.stream = 0x77
    assert call_run(ref) == 719 and call.failed == 1


def test_without_a_compiler_there_is_no_helper_and_it_is_not_tried_again(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    with caplog.at_level("INFO", logger="tilescale_lang.launch_records"):
        assert launch_records.helper() is None
    assert launch_records.call_helper() is None
    assert "no C helper" in caplog.text and "launching through ctypes" in caplog.text
    monkeypatch.setenv("CC", "cc")
    assert launch_records.helper() is None  # decided once per process


def test_library_path_and_records(fresh, monkeypatch):
    assert launch_records.library_path(compiler="cc") != launch_records.library_path(compiler="clang")
    assert launch_records.library_path(cache_dir="") is None
    assert launch_records.library_path().parent == fresh / "tilescale-launch"  # TileLang's cache directory
    monkeypatch.setattr(launch_records, "_tilelang_cache_dir", lambda: "")  # TileLang names none
    assert launch_records.library_path() is None
    assert launch_records.helper() is None  # no cache directory: nothing to compile into
    assert ctypes.sizeof(launch_records.make_records(2)) == 2 * ctypes.sizeof(launch_records.LaunchRecord)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must be a positive int"):
            launch_records.make_records(bad)
