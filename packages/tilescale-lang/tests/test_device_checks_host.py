"""Device-side checks of the headers, run on the host (issue 39): the code is taken from the
headers as they ship and compiled with the host C++ compiler around small stand-ins for the
metadata table, ``__trap`` (a C++ exception, counted), the copies and the barriers.

* ``remap`` (``common.cuh``): only PE -1 is local; with ``TILESCALE_CHECK_PE=1`` every other
  PE outside ``0..num_ranks-1`` traps, negative ones included (-2 used to write locally).
* ``checked_count`` (``debug.cuh``), the wrapper of signed run-time copy sizes: with
  ``TILESCALE_CHECK_PE=1`` or ``TILESCALE_DEBUG=1`` a negative count traps, naming the size
  argument, the value, the rank, the block and the thread (it used to become a byte count near
  2**64); non-negative counts, and every count with the checks off, come back unchanged.
* Team operations (``team.cuh``): a tensor without ``TEAM_MAGIC`` (zeroed memory) traps in
  every team operation instead of turning barriers and collectives into no-ops; a
  ``broadcast_block`` root outside ``[0, size)`` traps instead of skipping the copy.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import tilescale_lang

INCLUDE = Path(tilescale_lang.__file__).parent / "include" / "tilescale"
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler on PATH")

PRELUDE = r"""
#include <cstdio>
#include <string>
#define TILESCALE_DEVICE inline
#define __device__
#define __noinline__
struct Dim3 { unsigned x, y, z; };
static Dim3 blockIdx{0, 0, 0}, threadIdx{0, 0, 0};
static unsigned long long meta_data[1024];
struct Trap {};
static int g_traps = 0;
inline void __trap() { ++g_traps; throw Trap{}; }
namespace tilescale {
template <typename T> struct remove_const { typedef T type; };
template <typename T> struct remove_const<const T> { typedef T type; };
template <typename T> using value_t = typename remove_const<T>::type;
inline int get_rank() { return (int)meta_data[0]; }
inline int get_num_ranks() { return (int)meta_data[1]; }
}  // namespace tilescale
"""


def _build_and_run_stdout(tmp_path, name: str, source: str, defines=()) -> str:
    """Compile ``source`` with the host compiler, run it and return its standard output."""
    cpp = tmp_path / f"{name}.cpp"
    cpp.write_text(source)
    exe = tmp_path / name
    build = subprocess.run([COMPILER, "-std=c++17", "-O1", *defines, str(cpp), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def _cases(stdout: str) -> dict[str, str]:
    """``{case: result}`` of a program's ``CASE <case>: <result>`` lines."""
    return {k: v for k, _, v in (line[5:].partition(": ") for line in stdout.splitlines() if line.startswith("CASE "))}


def _build_and_run(tmp_path, name: str, source: str, defines=()) -> dict[str, str]:
    return _cases(_build_and_run_stdout(tmp_path, name, source, defines))


def _header_code(header: str, start: str, function: str) -> str:
    """The code of ``header`` from the line ``start`` to the end of ``function`` (the start of
    its signature), in namespace tilescale."""
    text = (INCLUDE / header).read_text(encoding="utf-8")
    first = text.index(start)
    end = text.index("\n}\n", text.index(function, first)) + 3
    return "namespace tilescale {\n" + text[first:end] + "}  // namespace tilescale\n"


# ------------------------------------------------------------------------------ remap
def remap_source() -> str:
    """``pe_out_of_range_trap`` (when compiled in) and ``remap`` as common.cuh defines them."""
    return _header_code("common.cuh", "#if TILESCALE_CHECK_PE\n/// Trap: a run-time PE",
                        "template <typename T> TILESCALE_DEVICE T* remap(")


REMAP_MAIN = r"""
int main() {
  meta_data[0] = 1;  // rank 1 of 2: heap bases 0x1000 and 0x2000
  meta_data[1] = 2;
  meta_data[2] = 0x1000;
  meta_data[3] = 0x2000;
  int* local = reinterpret_cast<int*>(0x2010);
  const int pes[] = {-1, 0, 1, 2, -2, -1000};
  for (int pe : pes) {
    try {
      int* p = tilescale::remap(local, pe);
      std::printf("CASE %d: %s 0x%llx\n", pe, p == local ? "local" : "remote",
                  (unsigned long long)reinterpret_cast<unsigned long long>(p));
    } catch (Trap&) {
      std::printf("CASE %d: trap\n", pe);
    }
  }
  return 0;
}
"""


@needs_compiler
def test_remap_only_minus_one_is_local(tmp_path):
    """A run-time PE of -2 is not local: with TILESCALE_CHECK_PE=1 it traps like any PE outside
    0..num_ranks-1 (it used to return the local address before the check)."""
    source = PRELUDE + remap_source() + REMAP_MAIN
    checked = _build_and_run(tmp_path, "remap_checked", source, ["-DTILESCALE_CHECK_PE=1"])
    assert checked["-1"].startswith("local")
    assert checked["0"] == "remote 0x1010" and checked["1"].startswith("local")  # PE 1 is this rank
    assert checked["2"] == "trap" and checked["-2"] == "trap" and checked["-1000"] == "trap", checked
    unchecked = _build_and_run(tmp_path, "remap_unchecked", source, ["-DTILESCALE_CHECK_PE=0"])
    assert unchecked["-1"].startswith("local") and unchecked["0"] == "remote 0x1010"
    assert not unchecked["-2"].startswith("local"), unchecked  # undefined without the check, never local


# ------------------------------------------------------------------------------ checked_count
def checked_count_source() -> str:
    """``negative_count_trap`` (when compiled in) and ``checked_count`` as debug.cuh defines them."""
    return _header_code("debug.cuh", "#if TILESCALE_DEBUG || TILESCALE_CHECK_PE\n/// Trap: a signed run-time element count",
                        "template <typename T> TILESCALE_DEVICE T checked_count(")


CHECKED_COUNT_MAIN = r"""
#include <climits>
template <typename T> void run(const char* name, T n) {
  try {
    T got = tilescale::checked_count(n, "put_block size");
    std::printf("CASE %s: value %lld\n", name, (long long)got);
  } catch (Trap&) {
    std::printf("CASE %s: trap\n", name);
  }
}

int main() {
  meta_data[0] = 3;  // rank 3 of 4
  meta_data[1] = 4;
  blockIdx = Dim3{5, 1, 0};
  threadIdx = Dim3{17, 0, 0};
  run<int>("int 0", 0);
  run<int>("int 7", 7);
  run<int>("int max", INT_MAX);
  run<long long>("int64 2**40", 1ll << 40);
  run<int>("int -5", -5);
  run<int>("int min", INT_MIN);
  run<long long>("int64 -2**40", -(1ll << 40));
  run<signed char>("int8 -3", (signed char)-3);
  std::printf("CASE traps: %d\n", g_traps);
  return 0;
}
"""


@needs_compiler
@pytest.mark.parametrize("switch", ["-DTILESCALE_CHECK_PE=1", "-DTILESCALE_DEBUG=1"])
def test_checked_count_traps_on_a_negative_count(tmp_path, switch):
    """With either check switch a negative run-time count traps with a message naming the size
    argument, the value, the rank, the block and the thread; other counts are returned as they
    are.  (Without the helper, -5 became the byte count 2**64 - 20.)"""
    off = "-DTILESCALE_DEBUG=0" if "CHECK_PE" in switch else "-DTILESCALE_CHECK_PE=0"
    stdout = _build_and_run_stdout(tmp_path, "count_checked", PRELUDE + checked_count_source() + CHECKED_COUNT_MAIN,
                                   [switch, off])
    out = _cases(stdout)
    assert out["int 0"] == "value 0" and out["int 7"] == "value 7" and out["int max"] == "value 2147483647"
    assert out["int64 2**40"] == f"value {1 << 40}"
    for case in ("int -5", "int min", "int64 -2**40", "int8 -3"):
        assert out[case] == "trap", (case, out)
    assert out["traps"] == "4"
    message = "[tilescale] put_block size = {} is negative: an element count must be >= 0; rank 3 block (5,1,0) thread (17,0,0)"
    for value in (-5, -(1 << 31), -(1 << 40), -3):
        assert message.format(value) in stdout, stdout


@needs_compiler
def test_checked_count_is_the_identity_without_the_checks(tmp_path):
    """Checks off: no trap and no clamp; every count, negative ones included, comes back as is
    (the documented choice: correct programs keep their machine code)."""
    out = _build_and_run(tmp_path, "count_unchecked", PRELUDE + checked_count_source() + CHECKED_COUNT_MAIN,
                         ["-DTILESCALE_CHECK_PE=0", "-DTILESCALE_DEBUG=0"])
    assert out["int -5"] == "value -5" and out["int min"] == f"value {-(1 << 31)}", out
    assert out["int64 -2**40"] == f"value {-(1 << 40)}" and out["int8 -3"] == "value -3"
    assert out["int 7"] == "value 7" and out["traps"] == "0"


@pytest.mark.parametrize("source,names", [
    (remap_source, ("pe_out_of_range_trap", "remap(")),
    (checked_count_source, ("negative_count_trap", "checked_count(")),
], ids=["remap", "checked_count"])
def test_header_code_is_extracted_whole(source, names):
    src = source()
    assert src.count("{") == src.count("}"), src
    assert all(name in src for name in names)


# ------------------------------------------------------------------------------ teams
def team_source() -> str:
    """The team helpers of team.cuh (everything inside its namespace)."""
    text = (INCLUDE / "team.cuh").read_text(encoding="utf-8")
    start = text.index("namespace tilescale {")
    end = text.index("}  // namespace tilescale", start) + len("}  // namespace tilescale\n")
    return text[start:end]


TEAM_STUBS = r"""
static std::string g_log;
namespace tilescale {
template <bool FENCE>
inline void barrier_members(unsigned int*, int me, int n, int start, int stride, unsigned int) {
  g_log += "barrier(" + std::to_string(me) + "/" + std::to_string(n) + ") ";
}
template <int U, bool A> inline void copy_block(void*, const void* src, unsigned long long bytes) {
  g_log += "copy(pe " + std::to_string((unsigned long long)src) + ", " + std::to_string(bytes) + ") ";
}
// remap stand-in: the "address" returned is the PE, so that copy() logs where it pulled from
template <typename T> inline T* remap(T*, int pe) { return reinterpret_cast<T*>((unsigned long long)pe); }
}  // namespace tilescale
"""

TEAM_MAIN = r"""
static int team[1024];
static int zeroed[1024];
static char buf[64];

template <typename F> void run(const char* name, F f) {
  g_log.clear();
  try {
    f();
    std::printf("CASE %s: ok %s\n", name, g_log.c_str());
  } catch (Trap&) {
    std::printf("CASE %s: trap %s\n", name, g_log.c_str());
  }
}

int main() {
  meta_data[0] = 0;  // rank 0 of 4
  meta_data[1] = 4;
  team[0] = 0; team[1] = 1; team[2] = 2; team[3] = 0x7e47ea11;  // members 0, 1
  using namespace tilescale;
  run("zeroed team_rank", [] { std::printf("rank %d\n", team_rank(zeroed)); });
  run("zeroed team_num_ranks", [] { std::printf("n %d\n", team_num_ranks(zeroed)); });
  run("zeroed team_translate_pe", [] { std::printf("pe %d\n", team_translate_pe(zeroed, 0)); });
  run("zeroed barrier", [] { barrier_team(zeroed); });
  run("zeroed broadcast", [] { broadcast_block(zeroed, buf, buf, 16, 0); });
  run("zeroed fcollect", [] { fcollect_block(zeroed, buf, buf, 16); });
  run("barrier", [] { barrier_team(team); });
  run("broadcast root 1", [] { broadcast_block(team, buf, buf, 16, 1); });
  run("broadcast root 2", [] { broadcast_block(team, buf, buf, 16, 2); });
  run("broadcast root -1", [] { broadcast_block(team, buf, buf, 16, -1); });
  run("fcollect", [] { fcollect_block(team, buf, buf, 8); });
  meta_data[0] = 3;  // rank 3 is not a member: every team operation returns at once
  run("non-member broadcast", [] { broadcast_block(team, buf, buf, 16, 0); });
  run("non-member barrier", [] { barrier_team(team); });
  return 0;
}
"""


@needs_compiler
def test_team_operations_trap_on_a_non_team_tensor_and_a_bad_root(tmp_path):
    source = PRELUDE + TEAM_STUBS + team_source() + TEAM_MAIN
    out = _build_and_run(tmp_path, "team", source, ["-DTILESCALE_CHECK_PE=0"])
    for op in ("team_rank", "team_num_ranks", "team_translate_pe", "barrier", "broadcast", "fcollect"):
        assert out[f"zeroed {op}"].startswith("trap"), (op, out)  # used to be a silent no-op
    assert out["barrier"] == "ok barrier(0/2) "
    assert out["broadcast root 1"] == "ok barrier(0/2) copy(pe 1, 16) barrier(0/2) "
    assert out["broadcast root 2"].startswith("trap") and "copy" not in out["broadcast root 2"], out
    assert out["broadcast root -1"].startswith("trap"), out
    assert out["fcollect"] == "ok barrier(0/2) copy(pe 0, 8) copy(pe 1, 8) barrier(0/2) "
    assert out["non-member broadcast"] == "ok " and out["non-member barrier"] == "ok "
