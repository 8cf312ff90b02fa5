"""The index logic of the device copies (``copy_words`` in ``include/tilescale/copy.cuh``,
behind every put/get/copy at thread, warp and block scope, and ``copy_rows_words``, behind the
strided ``put_rows_block`` / ``get_rows_block``), run on the host: the template is
taken from the header as it ships, compiled with the host C++ compiler, and every thread of a
simulated group runs it in turn. Each destination word must be written exactly once with its
source word, and nothing past the end may be touched, for every size around the full-round
and tail-round boundaries (the tail is the predicated round of fewer than UNROLL words)."""

from __future__ import annotations

from host_cxx import build_and_run, header_definition, needs_host_compiler

#: The harnesses' common start: a word type that counts the stores into the destination under test.
RECORDING_WORD = r"""
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
"""

HARNESS = RECORDING_WORD + r"""

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


def copy_words_source(name: str = "copy_words", params: str = "typename W, int UNROLL") -> str:
    """The template ``name`` (``copy_words``, ``copy_rows_words``, ``copy_rows_as``,
    ``coop_copy_rows`` with ``params="int UNROLL"``) as the header defines it, inside its
    namespace."""
    definition = header_definition("copy.cuh", f"template <{params}>\nTILESCALE_DEVICE void {name}(")
    return "namespace tilescale {\n" + definition + "}  // namespace tilescale\n"


ROWS_HARNESS = RECORDING_WORD + r"""

%(copy_rows_words)s

// rows x cols words, strides ss (source) and ds (destination): every word of every row lands
// once at its place; the gaps between destination rows and the words past the last row stay.
template <int U>
int check(unsigned long long rows, unsigned long long cols, unsigned long long ss, unsigned long long ds,
          unsigned int nthreads) {
  const unsigned long long guard = 64, n_src = rows * ss + cols + guard, n_dst = rows * ds + cols + guard;
  std::vector<Word> src(n_src), dst(n_dst);
  std::vector<int> writes(n_dst, 0);
  for (unsigned long long i = 0; i < n_src; ++i) src[i].v = 1000 + (long long)i;
  for (unsigned long long i = 0; i < n_dst; ++i) dst[i].v = -1;
  g_dst = dst.data(); g_writes = &writes; g_cap = n_dst;
  for (unsigned int tid = 0; tid < nthreads; ++tid)
    tilescale::copy_rows_words<Word, U>(dst.data(), src.data(), rows, cols, ds, ss, tid, nthreads);
  g_dst = nullptr;
  for (unsigned long long i = 0; i < n_dst; ++i) {
    const unsigned long long r = i / ds, c = i %% ds;
    const bool inside = ds > 0 && r < rows && c < cols;
    const long long want = inside ? src[r * ss + c].v : -1;
    if (writes[i] != (inside ? 1 : 0) || dst[i].v != want) {
      std::printf("U=%%d rows=%%llu cols=%%llu ss=%%llu ds=%%llu threads=%%u: word %%llu written %%d times, "
                  "value %%lld (want %%lld)\n", U, rows, cols, ss, ds, nthreads, i, writes[i], dst[i].v, want);
      return 1;
    }
  }
  return 0;
}

template <int U>
int sweep() {
  const unsigned int groups[] = {1, 3, 32, 512};
  const unsigned long long widths[] = {1, 2, 5, 31, 32, 33, 64, 100, 600};
  int bad = 0, cases = 0;
  for (unsigned int t : groups)
    for (unsigned long long cols : widths)
      for (unsigned long long rows : {0ull, 1ull, 2ull, 7ull, 40ull})
        for (unsigned long long extra : {0ull, 3ull, 64ull}) {
          // a slice of wider rows gathered into dense ones, and the other way round
          bad += check<U>(rows, cols, cols + extra, cols, t);
          bad += check<U>(rows, cols, cols, cols + extra, t);
          cases += 2;
        }
  std::printf("U=%%d: %%d cases, %%d bad\n", U, cases, bad);
  return bad;
}

int main() {
  int bad = sweep<1>() + sweep<2>() + sweep<3>() + sweep<4>() + sweep<8>();
  return bad ? 1 : 0;
}
"""


BYTES_HARNESS = r"""
#include <cstdio>
#include <cstring>
#include <vector>
#define TILESCALE_DEVICE inline
struct alignas(16) vec16 { unsigned int x, y, z, w; };
namespace tilescale { typedef ::vec16 vec16; }

%(copy_rows_words)s
%(copy_rows_as)s
%(coop_copy_rows)s

// A strided byte copy at every alignment of both pointers, row size and stride: the word the
// dispatcher picks must move each row's bytes exactly, and no byte outside the rows.
int check(unsigned so, unsigned dof, unsigned long long rows, unsigned long long row, unsigned long long ss,
          unsigned long long ds, unsigned nthreads) {
  const unsigned long long n_src = so + rows * ss + row + 64, n_dst = dof + rows * ds + row + 64;
  alignas(16) static unsigned char src[1 << 16], dst[1 << 16];
  for (unsigned long long i = 0; i < n_src; ++i) src[i] = (unsigned char)(i * 7 + 3);
  std::memset(dst, 0xEE, n_dst);
  for (unsigned t = 0; t < nthreads; ++t)
    tilescale::coop_copy_rows<4>(dst + dof, src + so, rows, row, ds, ss, t, nthreads);
  for (unsigned long long i = 0; i < n_dst; ++i) {
    const bool in = i >= dof && ds > 0 && (i - dof) / ds < rows && (i - dof) %% ds < row;
    const unsigned char want = in ? src[so + (i - dof) / ds * ss + (i - dof) %% ds] : 0xEE;
    if (dst[i] != want) {
      std::printf("so=%%u do=%%u rows=%%llu row=%%llu ss=%%llu ds=%%llu: byte %%llu is %%u, want %%u\n", so, dof,
                  rows, row, ss, ds, i, dst[i], want);
      return 1;
    }
  }
  return 0;
}

int main() {
  int bad = 0, cases = 0;
  for (unsigned so : {0u, 1u, 2u, 4u, 8u})
    for (unsigned dof : {0u, 2u, 8u, 16u})
      for (unsigned long long row : {1ull, 2ull, 6ull, 16ull, 48ull, 100ull})
        for (unsigned long long gap : {0ull, 4ull, 16ull})
          for (unsigned t : {1u, 32u, 96u}) {
            bad += check(so, dof, 5, row, row + gap, row, t) + check(so, dof, 5, row, row, row + gap, t);
            cases += 2;
          }
  std::printf("bytes: %%d cases, %%d bad\n", cases, bad);
  return bad ? 1 : 0;
}
"""


def test_copy_words_is_extracted_whole():
    src = copy_words_source()
    assert src.count("{") == src.count("}"), src
    assert "Tail round" in src and "#pragma unroll 1" in src


@needs_host_compiler
def test_copy_words_moves_every_word_once_on_the_host(tmp_path):
    out = build_and_run(tmp_path, "copy_words", HARNESS % {"copy_words": copy_words_source()})
    assert out.count(", 0 bad") == 5, out


@needs_host_compiler
def test_copy_rows_words_moves_every_row_word_once_on_the_host(tmp_path):
    """Rows narrower and wider than a round of threads, strides wider than the rows on either
    side, zero rows: each row word written once, the gaps and the words past the end never."""
    out = build_and_run(tmp_path, "copy_rows_words",
                         ROWS_HARNESS % {"copy_rows_words": copy_words_source("copy_rows_words")})
    assert out.count(", 0 bad") == 5, out


@needs_host_compiler
def test_copy_rows_picks_a_legal_word_at_every_alignment_on_the_host(tmp_path):
    """Misaligned pointers, odd row sizes and strides: the strided copy's word choice (16, 8,
    4, 2 or 1 bytes) moves exactly the rows' bytes."""
    source = BYTES_HARNESS % {"copy_rows_words": copy_words_source("copy_rows_words"),
                              "copy_rows_as": copy_words_source("copy_rows_as"),
                              "coop_copy_rows": copy_words_source("coop_copy_rows", "int UNROLL")}
    out = build_and_run(tmp_path, "coop_copy_rows", source)
    assert ", 0 bad" in out, out
