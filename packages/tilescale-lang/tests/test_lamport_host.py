"""The element logic of the Lamport exchange (``lamport_ready`` and ``lamport_encode`` in
``include/tilescale/lamport.cuh``), run on the host: the two templates are taken from the
header as it ships and compiled with the host C++ compiler. For 2-, 4- and 8-byte elements and
every placement of the sentinel (all ones) among a vector's elements: a vector is ready exactly
when no element is the sentinel, and the encoding replaces exactly the sentinel elements by the
canonical NaN, leaving every other bit pattern (other NaNs, -0.0, the NaN itself) as it is, so
an encoded vector is always ready."""

from __future__ import annotations

from host_cxx import build_and_run, header_definition, needs_host_compiler
from tilescale_lang.lamport import NAN_BITS

HARNESS = r"""
#include <cstdio>
#include <cstring>
#define TILESCALE_DEVICE inline
struct uint4 { unsigned int x, y, z, w; };
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
namespace tilescale {
%(templates)s
}

// Every vector whose elements are each either the sentinel or one of a few other patterns.
template <int ESIZE, unsigned long long NAN_BITS> int check() {
  const int n = 16 / ESIZE;
  const unsigned long long ones = ESIZE == 8 ? ~0ull : (1ull << (8 * ESIZE)) - 1;
  const unsigned long long others[4] = {0ull, 1ull << (8 * ESIZE - 1), NAN_BITS, ones - 1};  // 0, -0, NaN, NaN
  for (unsigned int mask = 0; mask < (1u << n); ++mask) {
    for (int o = 0; o < 4; ++o) {
      unsigned char bytes[16], want[16];
      for (int e = 0; e < n; ++e) {
        unsigned long long v = (mask >> e) & 1 ? ones : others[(o + e) %% 4];
        unsigned long long enc = v == ones ? NAN_BITS : v;
        std::memcpy(bytes + e * ESIZE, &v, ESIZE);
        std::memcpy(want + e * ESIZE, &enc, ESIZE);
      }
      uint4 vec;
      std::memcpy(&vec, bytes, 16);
      if (tilescale::lamport_ready<ESIZE>(vec) != (mask == 0)) {
        std::printf("ESIZE %%d mask %%x: ready %%d\n", ESIZE, mask, (int)tilescale::lamport_ready<ESIZE>(vec));
        return 1;
      }
      uint4 enc = tilescale::lamport_encode<ESIZE, NAN_BITS>(vec);
      if (std::memcmp(&enc, want, 16) != 0 || !tilescale::lamport_ready<ESIZE>(enc)) {
        std::printf("ESIZE %%d mask %%x others %%d: wrong encoding\n", ESIZE, mask, o);
        return 1;
      }
    }
  }
  return 0;
}

int main() {
  int bad = check<2, %(f16)#xull>() + check<2, %(bf16)#xull>() + check<4, %(f32)#xull>() + check<8, %(f64)#xull>();
  if (!bad) std::printf("ok\n");
  return bad;
}
"""


def templates() -> str:
    """``lamport_ready`` and ``lamport_encode`` as the header ships them."""
    return "\n".join(header_definition("lamport.cuh", f"template <int ESIZE{rest}> TILESCALE_DEVICE {ret} {name}(")
                     for rest, ret, name in (("", "bool", "lamport_ready"),
                                             (", unsigned long long NAN_BITS", "uint4", "lamport_encode")))


@needs_host_compiler
def test_lamport_ready_and_encode_on_the_host(tmp_path):
    source = HARNESS % dict(templates=templates(), f16=NAN_BITS["float16"], bf16=NAN_BITS["bfloat16"],
                            f32=NAN_BITS["float32"], f64=NAN_BITS["float64"])
    assert build_and_run(tmp_path, "lamport_host", source).strip() == "ok"
