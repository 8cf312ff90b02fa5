"""The autotuner on the CPU: search spaces, the GEMM space, the cache file and its lock, one
process tuning with a fake clock, cache reuse, cache_only, failing candidates, argument
errors, the decorator. (Several ranks: test_autotune_dist.py; a real GEMM: test_autotune_gpu.py.)"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
import torch

from tilescale_lang.autotune import (ENV_VAR, FORMAT, FORMAT_VERSION, AutotuneCacheMiss, NoValidCandidate,
                                     SearchSpace, TuneCache, autotune, gemm_rejection, gemm_space, key_hash,
                                     make_key, resolve_mode, tune)
from tilescale_lang.autotune.cache import DIRECTORY_NAME, LOCK_NAME, current_environment

#: A fixed environment: the key does not depend on this machine's GPU or toolkit.
ENV = {"gpu": "Fake GPU", "arch": "sm_90", "toolkit": "12.8", "tilelang": "0.1.15", "tilescale_lang": "0.1.0"}
AXES = {"block_m": (64, 128), "block_n": (64, 128, 256)}


class Launch:
    """A candidate's launch: returns ``output``; the fake timer reads ``config``."""

    def __init__(self, config, output):
        self.config, self.output = config, output

    def __call__(self):
        return self.output


class FakeClock:
    """``timer(launch)``: milliseconds from ``table(config)``; counts its calls."""

    def __init__(self, table):
        self.table, self.calls = table, 0

    def __call__(self, launch):
        self.calls += 1
        return self.table(launch.config)


def _good(config):
    return Launch(config, torch.ones(4))


def _tune(tmp_path, space=None, build=_good, clock=None, **kw):
    kw.setdefault("reference", torch.ones(4))
    kw.setdefault("environment", ENV)
    return tune(space or SearchSpace(AXES), build, name="toy", dtype=torch.float16, shapes={"m": 256, "n": 256},
                timer=clock or FakeClock(lambda c: c["block_m"] / c["block_n"]), cache_dir=tmp_path, **kw)


# ------------------------------------------------------------------------------ search space
def test_space_product_order_and_filter():
    space = SearchSpace(AXES, valid=lambda c: c["block_m"] <= c["block_n"])
    assert list(space.product())[:3] == [{"block_m": 64, "block_n": 64}, {"block_m": 64, "block_n": 128},
                                          {"block_m": 64, "block_n": 256}]
    assert space.size_unfiltered == 6 and len(space) == 5
    assert {"block_m": 128, "block_n": 64} not in space and {"block_m": 128, "block_n": 128} in space
    assert space.default() == {"block_m": 64, "block_n": 64}
    assert space.index({"block_n": 256, "block_m": 128}) == 4
    first = space.candidates()
    first[0]["block_m"] = 999  # callers get copies
    assert space.default() == {"block_m": 64, "block_n": 64}


def test_fingerprint_stable_across_processes_and_sensitive_to_changes():
    space = SearchSpace(AXES, valid=lambda c: c["block_m"] <= c["block_n"])
    code = ("from tilescale_lang.autotune import SearchSpace; "
            f"print(SearchSpace({AXES!r}, valid=lambda c: c['block_m'] <= c['block_n']).fingerprint())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert other.stdout.strip() == space.fingerprint(), other.stderr[-2000:]
    assert len(space.fingerprint()) == 16
    changed = [
        SearchSpace(AXES),  # the filter accepts more
        SearchSpace({"block_m": (64, 128), "block_n": (64, 128, 512)}, valid=lambda c: c["block_m"] <= c["block_n"]),
        SearchSpace({"block_m": (128, 64), "block_n": (64, 128, 256)}, valid=lambda c: c["block_m"] <= c["block_n"]),
        SearchSpace({**AXES, "num_stages": (3,)}, valid=lambda c: c["block_m"] <= c["block_n"]),
        SearchSpace({"block_m": (64, 128), "block_k": (64, 128, 256)}, valid=lambda c: c["block_m"] <= c["block_k"]),
    ]
    prints = [s.fingerprint() for s in changed]
    assert space.fingerprint() not in prints and len(set(prints)) == len(prints)
    same = SearchSpace(AXES, valid=lambda config: config["block_n"] >= config["block_m"], name="other name")
    assert same.fingerprint() == space.fingerprint()  # the candidates, not the filter's code or the label


@pytest.mark.parametrize("axes, valid, match", [
    ([("block_m", (64,))], None, "axes must be a mapping"),
    ({}, None, "axes must name at least one axis"),
    ({"block m": (64,)}, None, "identifiers"),
    ({"block_m": 64}, None, r"axes\['block_m'\] must be a sequence"),
    ({"block_m": ()}, None, r"axes\['block_m'\] has no values"),
    ({"block_m": (64, 64)}, None, "lists a value twice"),
    ({"block_m": (object(),)}, None, r"axes\['block_m'\] values must be an int"),
    ({"block_m": (float("nan"),)}, None, "must be finite"),
    ({"block_m": (64,)}, 3, "valid must be a callable"),
    ({"block_m": (64,)}, lambda c: 1, "valid must return a bool"),
    ({"block_m": (64,)}, lambda c: c["nope"], "valid raised KeyError"),
    ({"block_m": (64,)}, lambda c: False, "valid rejects all 1 candidates"),
])
def test_space_argument_errors(axes, valid, match):
    with pytest.raises((TypeError, ValueError), match=match):
        SearchSpace(axes, valid)


def test_gemm_space_and_rejections():
    space = gemm_space(1024, 3584, 8192, torch.bfloat16)
    assert space.axis_names == ("block_m", "block_n", "block_k", "num_stages", "threads")
    library_default = {"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "threads": 256}
    assert library_default in space  # the library's GemmTiles() is a candidate
    for config in space:
        assert 1024 % config["block_m"] == 0 and 3584 % config["block_n"] == 0
        assert config["num_stages"] * (config["block_m"] + config["block_n"]) * config["block_k"] * 2 <= 232448
    assert gemm_rejection({**library_default, "threads": 128}, 1024, 3584, 8192).startswith("a 128 x 256 float32")
    assert "shared memory" in gemm_rejection({**library_default, "block_k": 128, "num_stages": 4}, 1024, 3584, 8192)
    from tilescale_lang.autotune.gemm import gemm_shared_bytes

    assert gemm_shared_bytes(128, 256, 64, 3, torch.bfloat16) == 3 * (128 + 256) * 64 * 2
    assert gemm_shared_bytes(64, 64, 128, 8, "float32") == 8 * (64 + 64) * 128 * 4
    assert "n=3584 is not a multiple of block_n=384" == gemm_rejection({**library_default, "block_n": 384},
                                                                     1024, 3584, 8192)
    assert "warpgroups cannot split" in gemm_rejection({**library_default, "block_m": 64, "block_n": 200,
                                                        "threads": 256}, 64, 200, 64)
    more = gemm_space(1024, 3584, 8192, swizzle=(0, 8), persistent=(False, True), block_m=(128,))
    assert more.axis_names[-2:] == ("swizzle", "persistent") and len(more) == 4 * len(
        gemm_space(1024, 3584, 8192, block_m=(128,)))
    # The pipeline axis: the async pipeline needs two stages (a stage is released one step late).
    piped = gemm_space(1024, 3584, 8192, pipeline=("sync", "async"), block_m=(128,), num_stages=(1, 3))
    configs = list(piped)
    assert piped.axis_names[-1] == "pipeline"
    assert {(c["num_stages"], c["pipeline"]) for c in configs} == {(1, "sync"), (3, "sync"), (3, "async")}
    assert gemm_rejection({**library_default, "num_stages": 1, "pipeline": "async"}, 1024, 3584, 8192) == (
        "the async pipeline needs at least 2 stages")
    # The warp policy axis: opt-in, every tile under each policy.
    split = gemm_space(1024, 3584, 8192, warp_policy=("square", "row"), block_m=(128,))
    assert split.axis_names[-1] == "warp_policy" and len(split) == 2 * len(gemm_space(1024, 3584, 8192, block_m=(128,)))
    assert {c["warp_policy"] for c in split} == {"square", "row"}


@pytest.mark.parametrize("kwargs, match", [
    ({"m": 0}, "m must be a positive int"),
    ({"k": 8192.0}, "k must be a positive int"),
    ({"dtype": "float64"}, "dtype must be one of"),
    ({"block_m": ()}, "block_m must be a non-empty sequence"),
    ({"threads": (128, -1)}, "threads values must be a positive int"),
    ({"swizzle": (-1,)}, "swizzle values must be a non-negative int"),
    ({"persistent": (1,)}, "persistent values must be True or False"),
    ({"pipeline": ("fast",)}, "pipeline values must be among"),
    ({"pipeline": "sync"}, "pipeline must be a non-empty sequence"),
    ({"warp_policy": ("diagonal",)}, "warp_policy values must be among"),
    ({"smem_bytes": 0}, "smem_bytes must be a positive int"),
    ({"valid": "yes"}, "valid must be a callable"),
    ({"m": 64, "n": 64, "k": 64}, "no GEMM tile of the space fits m=64, n=64, k=64"),
])
def test_gemm_space_argument_errors(kwargs, match):
    args = {"m": 1024, "n": 3584, "k": 8192, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        gemm_space(args.pop("m"), args.pop("n"), args.pop("k"), **args)


# ------------------------------------------------------------------------------ the cache file
def _entry(time_ms=1.0):
    return {"config": {"block_m": 64, "block_n": 256}, "time_ms": time_ms, "policy": "root",
            "timings": [{"config": {"block_m": 64, "block_n": 256}, "time_ms": time_ms}],
            "skipped": [{"config": {"block_m": 128, "block_n": 64}, "stage": "compile", "error": "Boom: no"}]}


def test_cache_format_round_trip(tmp_path):
    cache = TuneCache(tmp_path)
    key = make_key("toy", SearchSpace(AXES), torch.bfloat16, {"m": 256, "shape": (2, 3)}, 2, ENV)
    assert key["dtype"] == "bfloat16" and key["shapes"] == {"m": 256, "shape": [2, 3]} and key["world_size"] == 2
    assert cache.load(key) is None
    path = cache.store(key, _entry())
    assert path == tmp_path / DIRECTORY_NAME / "toy.json"
    assert cache.lock_path == tmp_path / f"tilescale-locks-{os.getuid()}" / LOCK_NAME
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["format"] == FORMAT and data["version"] == FORMAT_VERSION
    stored = data["entries"][key_hash(key)]
    assert stored["key"] == key and stored["config"] == {"block_m": 64, "block_n": 256}
    assert set(stored) == {"key", "config", "time_ms", "policy", "timings", "skipped", "created"}
    assert time.strptime(stored["created"], "%Y-%m-%dT%H:%M:%SZ")
    assert cache.load(key) == stored
    other = dict(key, world_size=4)
    cache.store(other, _entry(2.0))
    assert len(cache.entries("toy")) == 2 and cache.load(other)["time_ms"] == 2.0
    cache.store(key, _entry(3.0))  # the same key again: replaced, not added
    assert len(cache.entries("toy")) == 2 and cache.load(key)["time_ms"] == 3.0


def test_cache_ignores_foreign_files_and_replaces_them(tmp_path):
    cache = TuneCache(tmp_path)
    key = make_key("toy", SearchSpace(AXES), "float16", [256, 256], 1, ENV)
    cache.path("toy").parent.mkdir(parents=True)
    cache.path("toy").write_text("{torn")
    with pytest.warns(RuntimeWarning, match="is not JSON"):
        assert cache.load(key) is None
    cache.path("toy").write_text(json.dumps({"format": "other", "entries": {}}))
    with pytest.warns(RuntimeWarning, match="not a tilescale-autotune version 1 file"):
        assert cache.load(key) is None
    with pytest.warns(RuntimeWarning):
        cache.store(key, _entry())
    assert cache.load(key)["config"] == {"block_m": 64, "block_n": 256}
    forged = json.loads(cache.path("toy").read_text(encoding="utf-8"))
    forged["entries"][key_hash(key)]["key"]["world_size"] = 8  # an edited key: not this entry
    cache.path("toy").write_text(json.dumps(forged))
    assert cache.load(key) is None
    assert cache.path("a/b c").name == "a_b_c.json"


def _writer(cache_dir, key, own_key, ready, start, rounds):
    """Write ``key`` and ``own_key`` ``rounds`` times each once ``start`` is set (spawned, or
    in the test's process)."""
    cache = TuneCache(cache_dir)
    if ready is not None:
        ready.set()
    start.wait(60)
    for i in range(rounds):
        cache.store(key, _entry(float(os.getpid() % 1000 + i + 1)))
        cache.store(own_key, _entry(float(i + 1)))


def _read_until(path, stop, reads):
    """Read ``path`` without the lock until ``stop``; every read must parse (no torn file)."""
    while not stop.is_set():
        if path.exists():
            reads.append(json.loads(path.read_text(encoding="utf-8"))["format"])
        time.sleep(0.001)


def test_lock_two_processes_one_entry_no_torn_file(tmp_path):
    """A spawned process and this one write the same key at once: one entry for it, each
    writer's own key kept (no lost update), and a reader without the lock never sees a torn
    file. (One spawned writer, not two: a spawn pays torch's and TileLang's import.)"""
    import threading

    space = SearchSpace(AXES)
    key = make_key("toy", space, "float16", [256], 1, ENV)
    own = [make_key("toy", space, "float16", [256], 1, ENV, extra={"writer": w}) for w in range(2)]
    ctx = mp.get_context("spawn")
    ready, start = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_writer, args=(str(tmp_path), key, own[1], ready, start, 40))
    child.start()
    try:
        assert ready.wait(60), "the spawned writer did not start"
        path, stop, reads = TuneCache(tmp_path).path("toy"), threading.Event(), []
        reader = threading.Thread(target=_read_until, args=(path, stop, reads))
        reader.start()
        start.set()
        _writer(str(tmp_path), key, own[0], None, start, 40)
        child.join(60)
        stop.set()
        reader.join(10)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    entries = TuneCache(tmp_path).entries("toy")
    assert set(entries) == {key_hash(key), key_hash(own[0]), key_hash(own[1])}  # no lost update, one entry per key
    assert entries[key_hash(own[0])]["time_ms"] == entries[key_hash(own[1])]["time_ms"] == 40.0
    assert not [f for f in path.parent.iterdir() if f.name.endswith(".tmp")]
    assert reads and set(reads) == {FORMAT}


# ------------------------------------------------------------------------------ tuning, one process
def test_tune_picks_the_fastest_and_caches_it(tmp_path):
    clock = FakeClock(lambda c: c["block_m"] / c["block_n"])
    result = _tune(tmp_path, clock=clock)
    assert result.source == "tuned" and result.config == {"block_m": 64, "block_n": 256}
    assert result.time_ms == 0.25 and clock.calls == 6 and len(result.timings) == 6 and not result.skipped
    entry = TuneCache(tmp_path).load(result.key)
    assert entry["config"] == result.config and entry["policy"] == "root" and len(entry["timings"]) == 6
    builds = []
    again_clock = FakeClock(lambda c: 1.0)
    again = _tune(tmp_path, clock=again_clock, build=lambda c: builds.append(c) or _good(c))
    assert again.source == "cache" and again.config == result.config and again.time_ms == 0.25
    assert again_clock.calls == 0 and builds == []  # reused without compiling or timing
    assert again.key_hash == result.key_hash and again.path == result.path


def test_prepare_sees_every_candidate_once_and_only_when_tuning(tmp_path):
    seen = []
    result = _tune(tmp_path, prepare=lambda configs: seen.append(configs))
    assert result.source == "tuned" and seen == [list(SearchSpace(AXES))]
    assert _tune(tmp_path, prepare=lambda configs: seen.append(configs)).source == "cache" and len(seen) == 1
    with pytest.warns(RuntimeWarning, match="prepare failed"):  # a failing prepare: each build compiles
        assert _tune(tmp_path / "other", prepare=lambda configs: 1 / 0).source == "tuned"


def test_ties_go_to_the_earlier_candidate(tmp_path):
    assert _tune(tmp_path, clock=FakeClock(lambda c: 1.0)).config == {"block_m": 64, "block_n": 64}


def test_cache_key_changes_retune(tmp_path):
    _tune(tmp_path)
    for change in ({"environment": dict(ENV, toolkit="13.0")}, {"extra": {"layout": "nt"}},
                   {"space": SearchSpace(AXES, valid=lambda c: c["block_m"] == 128)}):
        clock = FakeClock(lambda c: 1.0)
        result = _tune(tmp_path, clock=clock, **change)
        assert result.source == "tuned" and clock.calls > 0, change
    assert len(TuneCache(tmp_path).entries("toy")) == 4


def test_cache_only_miss_names_the_key(tmp_path):
    with pytest.raises(AutotuneCacheMiss) as info:
        _tune(tmp_path, mode="cache_only")
    message = str(info.value)
    assert "cache_only" in message and "'shapes': {'m': 256, 'n': 256}" in message and "toy.json" in message
    assert info.value.key["name"] == "toy" and isinstance(info.value, LookupError)
    _tune(tmp_path)
    assert _tune(tmp_path, mode="cache_only", clock=FakeClock(lambda c: 1 / 0)).source == "cache"


def test_mode_off_runs_the_first_candidate_untimed(tmp_path):
    clock = FakeClock(lambda c: 1 / 0)
    result = _tune(tmp_path, mode="off", clock=clock, build=lambda c: 1 / 0)
    assert result.source == "off" and result.config == {"block_m": 64, "block_n": 64} and clock.calls == 0
    assert not TuneCache(tmp_path).path("toy").exists()


def test_environment_variable_is_the_default_mode(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "cache_only")
    assert resolve_mode(None) == "cache_only" and resolve_mode("on") == "on"  # the argument wins
    with pytest.raises(AutotuneCacheMiss):
        _tune(tmp_path)
    monkeypatch.setenv(ENV_VAR, "off")
    assert _tune(tmp_path).source == "off"
    monkeypatch.setenv(ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="TILESCALE_AUTOTUNE must be one of"):
        _tune(tmp_path)
    monkeypatch.delenv(ENV_VAR)
    assert resolve_mode(None) == "on"


def _flaky_build(config):
    if config["block_n"] == 256:
        raise RuntimeError(f"nvcc: too many resources for {config}")
    if config["block_m"] == 128 and config["block_n"] == 64:
        return Launch(config, torch.zeros(4))  # compiles, computes the wrong thing
    if config == {"block_m": 64, "block_n": 64}:
        return "not a launch"
    return Launch(config, torch.ones(4))


def test_failing_candidates_are_skipped_and_reported(tmp_path):
    clock = FakeClock(lambda c: {64: 2.0, 128: 1.0}[c["block_n"]] + c["block_m"] / 1000)
    result = _tune(tmp_path, build=_flaky_build, clock=clock)
    assert result.config == {"block_m": 64, "block_n": 128} and clock.calls == 2  # only survivors are timed
    stages = {(s.config["block_m"], s.config["block_n"]): s for s in result.skipped}
    assert {k: s.stage for k, s in stages.items()} == {(64, 64): "compile", (64, 256): "compile",
                                                       (128, 64): "check", (128, 256): "compile"}
    assert "build(config) must return a callable" in stages[(64, 64)].error
    assert stages[(64, 256)].error.startswith("RuntimeError: nvcc: too many resources")
    assert "Tensor-likes are not close" in stages[(128, 64)].error
    skipped = TuneCache(tmp_path).load(result.key)["skipped"]
    assert [s["stage"] for s in skipped] == ["compile", "compile", "check", "compile"]


def test_bad_timings_and_checks_are_skipped(tmp_path):
    clock = FakeClock(lambda c: {64: float("nan"), 128: 0.0, 256: 3.0}[c["block_n"]])
    result = _tune(tmp_path, clock=clock, reference=None, check=lambda out: bool(out.sum() == 4))
    assert result.config == {"block_m": 64, "block_n": 256}
    assert sorted(s.stage for s in result.skipped) == ["time"] * 4
    assert "timer returned nan" in result.skipped[0].error


def test_no_survivor_is_a_clear_error(tmp_path):
    with pytest.raises(NoValidCandidate) as info:
        _tune(tmp_path, build=lambda c: Launch(c, torch.zeros(4)))
    assert "none of the 6 candidates survived" in str(info.value) and len(info.value.skipped) == 6
    assert "check: {'block_m': 64, 'block_n': 64}" in str(info.value)
    with pytest.raises(NoValidCandidate, match=r"check\(output\) returned False, not True"):
        _tune(tmp_path, reference=None, check=lambda out: False)
    assert not TuneCache(tmp_path).path("toy").exists()


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "fastest"}, "policy must be one of"),
    ({"mode": "always"}, "mode must be one of"),
    ({"build": "kernel"}, "build must be a callable"),
    ({"check": lambda out: True}, "exactly one of reference"),
    ({"reference": None}, "exactly one of reference"),
    ({"reference": None, "check": 3}, "check must be a callable"),
    ({"timer": 5}, "timer must be a callable"),
    ({"prepare": 5}, "prepare must be a callable"),
    ({"name": ""}, "name must be a non-empty str"),
    ({"dtype": None}, "dtype must be given"),
    ({"shapes": {"m": {1, 2}}}, r"shapes\['m'\] must be an int, float, str"),
    ({"shapes": {1: 2}}, "shapes keys must be str"),
    ({"extra": {"x": object()}}, r"extra\['x'\] must be"),
    ({"group": object()}, "group was given but torch.distributed is not initialised"),
    ({"space": {"block_m": (64,)}}, "space must be a SearchSpace"),
    ({"environment": {"gpu": "x"}}, "environment must be a mapping with the fields"),
    ({"cache_dir": ""}, "cache_dir is empty"),
])
def test_argument_errors_name_the_argument(tmp_path, kwargs, match):
    args = dict(space=SearchSpace(AXES), build=_good, name="toy", dtype=torch.float16, shapes={"m": 1},
                reference=torch.ones(4), timer=FakeClock(lambda c: 1.0), cache_dir=tmp_path, environment=ENV)
    args.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        tune(args.pop("space"), args.pop("build"), **args)


def test_current_environment_fields():
    env = current_environment()
    assert set(env) == set(ENV) and env["tilescale_lang"] == "0.1.0"
    if not torch.cuda.is_available():
        assert env["gpu"] == env["arch"] == "none"


# ------------------------------------------------------------------------------ the decorator
def test_decorator_tunes_once_per_key_and_calls_the_winner(tmp_path):
    calls = []
    clock = FakeClock(lambda c: 1.0)

    @autotune(SearchSpace({"scale": (1, 2, 3)}), key_fn=lambda x: {"dtype": x.dtype, "shapes": [tuple(x.shape)]},
              reference_fn=lambda x: x * 2, timer=lambda launch: clock(Launch({}, None)), cache_dir=tmp_path,
              environment=ENV, name="scaled")
    def scaled(x, *, scale):
        calls.append(scale)
        return x * scale

    x = torch.arange(4.0)
    assert torch.equal(scaled(x), x * 2) and clock.calls == 1  # only scale=2 passes the check
    assert calls == [1, 2, 3, 2]  # each candidate's check, then the winner's call
    assert torch.equal(scaled(x), x * 2) and clock.calls == 1 and calls[-1] == 2 and len(calls) == 5
    (result,) = scaled.results.values()
    assert result.config == {"scale": 2} and result.path.name == "scaled.json"
    with pytest.raises(ValueError, match=r"keyword arguments \['scale'\] are axes"):
        scaled(x, scale=3)


@pytest.mark.parametrize("kwargs, match", [
    ({"key_fn": None}, "key_fn must be a callable"),
    ({"check": lambda out, x: True}, "exactly one of reference_fn"),
    ({"space": 3}, "space must be a SearchSpace or a callable"),
    ({"policy": "root", "bogus": 1}, r"unexpected keyword arguments \['bogus'\]"),
])
def test_decorator_argument_errors(kwargs, match):
    args = dict(space=SearchSpace({"scale": (1,)}), key_fn=lambda x: {"dtype": "f", "shapes": []},
                reference_fn=lambda x: x)
    args.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=match):
        autotune(args.pop("space"), **args)(lambda x, scale: x)
