"""Communicator identities, computed the same way bpf/nccl.c computes them.

The BPF program hashes the 128-byte ncclUniqueId at the entry of each init
call. These are the reference implementations: tests hold the kernel's values
against them, and users can compute them from a unique id they logged.
"""

import struct

MASK64 = (1 << 64) - 1
UNIQUE_ID_BYTES = 128

# Mixed into a parent's hash to name a communicator made by ncclCommSplit.
SPLIT_TAG = 0x53504C4954434F4D  # "SPLITCOM"


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def comm_id_hash(unique_id: bytes) -> int:
    """splitmix64 fold over all sixteen little-endian u64 words of the id.

    Every word counts, so two ids that share NCCL's 8-byte magic prefix (the
    usual case) still get different hashes.
    """
    _check_len(unique_id)
    h = 0
    for word in struct.unpack("<16Q", unique_id):
        h = splitmix64(h ^ word)
    return h


def nccl_comm_hash(unique_id: bytes) -> int:
    """NCCL's own commHash: getHash(commId->internal, 128), DJB2a.

    result = result * 33 ^ c, where c is a *signed* char on x86-64, so bytes
    >= 0x80 are sign-extended before the xor, as in NCCL's C code.
    """
    _check_len(unique_id)
    result = 5381
    for byte in unique_id:
        signed = byte - 256 if byte >= 128 else byte
        result = (((result << 5) + result) ^ (signed & MASK64)) & MASK64
    return result


def split_comm_id_hash(parent_hash: int, color: int, split_seq: int) -> int:
    """Identity of the child made by the split_seq-th ncclCommSplit on a parent.

    Every rank of the parent calls ncclCommSplit the same number of times (it
    is collective), so (parent, sequence, color) is equal on every rank that
    lands in the same child, with no communication between agents.
    """
    mixed = splitmix64(parent_hash ^ SPLIT_TAG)
    return splitmix64(mixed ^ (((split_seq & 0xFFFFFFFF) << 32) | (color & 0xFFFFFFFF)))


def format_hash(h: int) -> str:
    return f"{h & MASK64:016x}"


def _check_len(unique_id: bytes) -> None:
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"a ncclUniqueId is {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
