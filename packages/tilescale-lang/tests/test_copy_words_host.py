"""The index logic of the device copies (``copy_words`` in ``include/tilescale/copy.cuh``,
behind every put/get/copy at thread, warp and block scope), run on the host: the template is
taken from the header as it ships, compiled with the host C++ compiler, and every thread of a
simulated group runs it in turn. Each destination word must be written exactly once with its
source word, and nothing past the end may be touched, for every size around the full-round
and tail-round boundaries (the tail is the predicated round of fewer than UNROLL words)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import tilescale_lang

HEADER = Path(tilescale_lang.__file__).parent / "include" / "tilescale" / "copy.cuh"
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

HARNESS = r"""
#include <cstdio>
#include <vector>
#define TILESCALE_DEVICE inline

// A word that records every store into the destination under test.
struct Word;
static Word* g_dst = nullptr;
static std::vector<int>* g_writes = nullptr;
static unsigned long long g_cap = 0;
struct Word {
  long long v;
  Word& operator=(const Word& o) {
    v = o.v;
    if (g_dst && this >= g_dst && this < g_dst + g_cap) ++(*g_writes)[this - g_dst];
    return *this;
  }
};

%(copy_words)s

template <int U>
int check(unsigned long long n, unsigned int nthreads) {
  const unsigned long long guard = 4ull * U * nthreads + 8;
  std::vector<Word> src(n + guard), dst(n + guard);
  std::vector<int> writes(n + guard, 0);
  for (unsigned long long i = 0; i < n + guard; ++i) { src[i].v = 1000 + (long long)i; dst[i].v = -1; }
  g_dst = dst.data(); g_writes = &writes; g_cap = n + guard;
  for (unsigned int tid = 0; tid < nthreads; ++tid)
    tilescale::copy_words<Word, U>(dst.data(), src.data(), n, tid, nthreads);
  g_dst = nullptr;
  for (unsigned long long i = 0; i < n + guard; ++i) {
    bool inside = i < n;
    if (inside && (writes[i] != 1 || dst[i].v != src[i].v)) {
      std::printf("U=%%d n=%%llu threads=%%u: word %%llu written %%d times, value %%lld\n", U, n, nthreads, i, writes[i], dst[i].v);
      return 1;
    }
    if (!inside && (writes[i] != 0 || dst[i].v != -1)) {
      std::printf("U=%%d n=%%llu threads=%%u: word %%llu past the end was written\n", U, n, nthreads, i);
      return 1;
    }
  }
  return 0;
}

template <int U>
int sweep() {
  const unsigned int groups[] = {1, 3, 32, 512};
  int bad = 0, cases = 0;
  for (unsigned int t : groups) {
    const unsigned long long top = 3ull * U * t + 2ull * t + 3;
    const unsigned long long step = t >= 512 ? 37 : 1;  // every size for small groups
    for (unsigned long long n = 0; n <= top; n += step) { bad += check<U>(n, t); ++cases; }
    for (unsigned long long r = 0; r < 3; ++r)  // exact round multiples and their neighbours
      for (long long d = -1; d <= 1; ++d) {
        long long n = (long long)((r + 1) * U * t) + d;
        if (n >= 0) { bad += check<U>((unsigned long long)n, t); ++cases; }
      }
  }
  std::printf("U=%%d: %%d cases, %%d bad\n", U, cases, bad);
  return bad;
}

int main() {
  int bad = sweep<1>() + sweep<2>() + sweep<3>() + sweep<4>() + sweep<8>();
  return bad ? 1 : 0;
}
"""


def copy_words_source() -> str:
    """The ``copy_words`` template as the header defines it, inside its namespace."""
    text = HEADER.read_text(encoding="utf-8")
    start = text.index("template <typename W, int UNROLL>\nTILESCALE_DEVICE void copy_words(")
    end = text.index("\n}\n", start) + 3
    return "namespace tilescale {\n" + text[start:end] + "}  // namespace tilescale\n"


def test_copy_words_is_extracted_whole():
    src = copy_words_source()
    assert src.count("{") == src.count("}"), src
    assert "Tail round" in src and "#pragma unroll 1" in src


@pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler on PATH")
def test_copy_words_moves_every_word_once_on_the_host(tmp_path):
    cpp = tmp_path / "copy_words.cpp"
    cpp.write_text(HARNESS % {"copy_words": copy_words_source()})
    exe = tmp_path / "copy_words"
    build = subprocess.run([COMPILER, "-std=c++17", "-O1", "-Wno-unknown-pragmas", str(cpp), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(", 0 bad") == 5, run.stdout
