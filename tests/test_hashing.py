"""exporter/hashing.py against independent implementations.

- a C program compiled with gcc: NCCL's eatHash/digestHash (bitops.h of NCCL
  >= 2.23: any byte count, chunks of up to 8 bytes), the splitmix64 fold and
  the split derivations, with C's own u64 wrap-around;
- the real library's own hash functions: tests/test_real_nccl.py;
- a second Python implementation in another style (ctypes fixed-width ints);
- fixed vectors, so a change of definition is caught even if both sides move.
"""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess

import pytest

from exporter.sources.nccl import hashing

HASH_C = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* NCCL's hash state: two words; eating n bytes xors n into the first, then
   runs one round per chunk of up to 8 bytes (little-endian, zero-filled). */
static void eat(uint64_t acc[2], const void *bytes, size_t n) {
  const unsigned char *p = bytes;
  acc[0] ^= n;
  while (n > 0) {
    size_t take = n < 8 ? n : 8;
    uint64_t chunk = 0;
    acc[0] += acc[1];
    acc[1] ^= acc[0];
    acc[0] ^= acc[0] >> 31;
    acc[0] *= 0x9de62bbc8cef3ce3ULL;
    acc[1] ^= acc[1] >> 32;
    acc[1] *= 0x485cd6311b599e79ULL;
    memcpy(&chunk, p, take);  /* x86-64: little-endian */
    acc[0] += chunk;
    p += take;
    n -= take;
  }
}

static uint64_t digest(const uint64_t acc[2]) {
  uint64_t h = acc[0];
  h ^= h >> 31;
  h *= 0xbac3bd562846de6bULL;
  h += acc[1];
  h ^= h >> 32;
  h *= 0x995a187a14e7b445ULL;
  return h;
}

static uint64_t splitmix64(uint64_t x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/* stdin lines:  id <256 hex digits>  |  split <parent hex> <color> <seq>
                 |  nsplit <parent nccl hash hex> <count> <color> */
int main(void) {
  char kind[8];
  while (scanf("%7s", kind) == 1) {
    if (!strcmp(kind, "id")) {
      unsigned char id[128];
      for (int i = 0; i < 128; i++) if (scanf("%2hhx", &id[i]) != 1) return 2;
      uint64_t w[16], h = 0;
      memcpy(w, id, sizeof(w));
      for (int i = 0; i < 16; i++) h = splitmix64(h ^ w[i]);
      uint64_t acc[2] = {1, 1};
      eat(acc, id, sizeof(id));
      printf("%016llx %016llx\n", (unsigned long long)h, (unsigned long long)digest(acc));
    } else if (!strcmp(kind, "split")) {
      unsigned long long parent; int color; unsigned int seq;
      if (scanf("%llx %d %u", &parent, &color, &seq) != 3) return 2;
      uint64_t mixed = splitmix64(parent ^ 0x53504C4954434F4DULL);
      uint64_t child = splitmix64(mixed ^ (((uint64_t)seq << 32) | (uint64_t)(uint32_t)color));
      printf("%016llx\n", (unsigned long long)child);
    } else if (!strcmp(kind, "nsplit")) {
      unsigned long long parent; int count, color;
      if (scanf("%llx %d %d", &parent, &count, &color) != 3) return 2;
      uint64_t acc[2] = {1, 1}, p64 = parent;
      eat(acc, &p64, sizeof(p64));
      eat(acc, &count, sizeof(count));
      eat(acc, &color, sizeof(color));
      printf("%016llx\n", (unsigned long long)digest(acc));
    } else {
      return 2;
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def c_hash(tmp_path_factory):
    """Run the C reference on a batch of requests; returns its output lines."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed (make deps)")
    d = tmp_path_factory.mktemp("hash-c")
    (d / "hash.c").write_text(HASH_C)
    exe = d / "hash"
    subprocess.run([gcc, "-O2", "-Wall", "-o", str(exe), str(d / "hash.c")], check=True)

    def run(lines: list[str]) -> list[str]:
        out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True,
                             text=True, check=True).stdout
        return out.split("\n")[:-1]

    return run


def _ids() -> list[bytes]:
    rng = random.Random(20240611)
    ids = [bytes(128), bytes(range(128)), bytes(range(128, 256)), b"\xff" * 128]
    ids += [bytes(rng.getrandbits(8) for _ in range(128)) for _ in range(40)]
    # NCCL-like: an 8-byte magic, then a socket address, then zeros.
    ids += [bytes.fromhex("2bc9a5f1c6d3e4b7") + rng.randbytes(28) + bytes(92) for _ in range(10)]
    return ids


# --- a second implementation, another style ----------------------------------------

def _mix(x: int) -> int:
    z = ctypes.c_uint64(x + 0x9E3779B97F4A7C15).value
    z = ctypes.c_uint64((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9).value
    z = ctypes.c_uint64((z ^ (z >> 27)) * 0x94D049BB133111EB).value
    return z ^ (z >> 31)


def _fold(uid: bytes) -> int:
    h = 0
    for off in range(0, 128, 8):
        h = _mix(h ^ int.from_bytes(uid[off:off + 8], "little"))
    return h


def _nccl_hash(data: bytes) -> int:
    """NCCL's getHash, byte chunks taken with ctypes from a zero-padded buffer."""
    a0, a1 = ctypes.c_uint64(1 ^ len(data)), ctypes.c_uint64(1)
    padded = data + bytes(-len(data) % 8)
    for off in range(0, len(padded), 8):
        a0.value += a1.value
        a1.value ^= a0.value
        a0.value = (a0.value ^ (a0.value >> 31)) * 0x9DE62BBC8CEF3CE3
        a1.value = (a1.value ^ (a1.value >> 32)) * 0x485CD6311B599E79
        a0.value += ctypes.c_uint64.from_buffer_copy(padded, off).value
    h = ctypes.c_uint64((a0.value ^ (a0.value >> 31)) * 0xBAC3BD562846DE6B)
    h.value += a1.value
    return ctypes.c_uint64((h.value ^ (h.value >> 32)) * 0x995A187A14E7B445).value


# --- tests -------------------------------------------------------------------------------

def test_fixed_vectors():
    # splitmix64 with seed 0: the first two outputs of Vigna's reference generator.
    assert hashing.splitmix64(0) == 0xE220A8397B1DCDAF
    assert hashing.splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    # Computed once with the C reference above (NCCL hash: also equal to the 2.32 wheel's own).
    assert hashing.agent_comm_hash(bytes(128)) == 0x676DAC289584BCC9
    assert hashing.nccl_comm_hash(bytes(128)) == 0xCC976EC6C24BB53C
    assert hashing.agent_comm_hash(bytes(range(128))) == 0x5B074B4237243D35
    assert hashing.nccl_comm_hash(bytes(range(128))) == 0x6AFE1CC17717E1F4
    assert hashing.agent_comm_hash(bytes(range(128, 256))) == 0x96196B9FF33E3BD0
    assert hashing.nccl_comm_hash(bytes(range(128, 256))) == 0x1379339BDC3AFBDC


def test_matches_c_reference(c_hash):
    ids = _ids()
    out = c_hash(["id " + uid.hex() for uid in ids])
    assert len(out) == len(ids)
    for uid, line in zip(ids, out):
        fold, nccl = (int(x, 16) for x in line.split())
        assert hashing.agent_comm_hash(uid) == fold, uid.hex()
        assert hashing.nccl_comm_hash(uid) == nccl, uid.hex()


def test_nccl_split_hash_matches_c_reference(c_hash):
    parent = hashing.nccl_comm_hash(bytes(range(128)))
    cases = [(parent, 1, 0), (parent, 2, 0), (parent, 1, 1), (parent, 3, -2),
             (0xFFFFFFFFFFFFFFFF, 123456, 2147483647), (1, 1, -1)]
    out = c_hash([f"nsplit {p:x} {n} {c}" for p, n, c in cases])
    assert len(out) == len(cases)
    for (p, n, c), line in zip(cases, out):
        assert hashing.split_nccl_comm_hash(p, n, c) == int(line, 16), (p, n, c)
    children = {hashing.split_nccl_comm_hash(parent, n, c) for n in range(1, 9) for c in range(8)}
    assert len(children) == 64  # count- and color-sensitive


def test_matches_second_python_implementation():
    for uid in _ids():
        assert hashing.agent_comm_hash(uid) == _fold(uid)
        assert hashing.nccl_comm_hash(uid) == _nccl_hash(uid)


def test_every_word_counts():
    rng = random.Random(7)
    base = bytes.fromhex("2bc9a5f1c6d3e4b7") + rng.randbytes(120)
    seen = {hashing.agent_comm_hash(base)}
    for i in range(8, 128):  # same 8-byte magic, one byte different anywhere after it
        other = bytearray(base)
        other[i] ^= 0x01
        seen.add(hashing.agent_comm_hash(bytes(other)))
    assert len(seen) == 121
    # Two ids sharing everything but the last word.
    a = bytes(120) + (1).to_bytes(8, "little")
    b = bytes(120) + (2).to_bytes(8, "little")
    assert hashing.agent_comm_hash(a) != hashing.agent_comm_hash(b)
    assert hashing.nccl_comm_hash(a) != hashing.nccl_comm_hash(b)


def test_wrong_length_is_refused():
    for n in (0, 8, 127, 129, 256):
        with pytest.raises(ValueError):
            hashing.agent_comm_hash(bytes(n))
        with pytest.raises(ValueError):
            hashing.nccl_comm_hash(bytes(n))


def test_split_hash(c_hash):
    parent = hashing.agent_comm_hash(bytes(range(128)))
    child = hashing.split_agent_comm_hash(parent, 3, 0)
    assert child == hashing.split_agent_comm_hash(parent, 3, 0)  # deterministic
    assert child != parent
    colors = {hashing.split_agent_comm_hash(parent, c, 0) for c in range(64)}
    assert len(colors) == 64  # color-sensitive
    seqs = {hashing.split_agent_comm_hash(parent, 3, s) for s in range(64)}
    assert len(seqs) == 64  # the n-th split of a parent differs from the (n+1)-th
    assert hashing.split_agent_comm_hash(parent ^ 1, 3, 0) != child  # parent-sensitive
    # Negative colors (NCCL_SPLIT_NOCOLOR = -1) are the u32 bit pattern, as in the BPF code.
    assert hashing.split_agent_comm_hash(parent, -1, 0) == hashing.split_agent_comm_hash(parent, 0xFFFFFFFF, 0)

    cases = [(parent, 3, 0), (parent, 0, 0), (parent, -1, 2), (parent, 7, 5),
             (0xFFFFFFFFFFFFFFFF, 123456, 4000000000), (1, -2, 1)]
    out = c_hash([f"split {p:x} {c} {s}" for p, c, s in cases])
    for (p, c, s), line in zip(cases, out):
        assert hashing.split_agent_comm_hash(p, c, s) == int(line, 16), (p, c, s)


def test_format_hash():
    assert hashing.format_hash(0) == "0000000000000000"
    assert hashing.format_hash(0xABC) == "0000000000000abc"
    assert hashing.format_hash(-1) == "ffffffffffffffff"
    assert len(hashing.format_hash(hashing.agent_comm_hash(bytes(128)))) == 16
