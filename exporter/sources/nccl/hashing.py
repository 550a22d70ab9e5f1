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


def agent_comm_hash(unique_id: bytes) -> int:
    """splitmix64 fold over all sixteen little-endian u64 words of the id.

    Every word counts, so two ids that share NCCL's 8-byte magic prefix (the
    usual case) still get different hashes.
    """
    _check_len(unique_id)
    h = 0
    for word in struct.unpack("<16Q", unique_id):
        h = splitmix64(h ^ word)
    return h


# NCCL's hash (src/include/bitops.h of NCCL >= 2.23: eatHash/digestHash; the
# same code in the 2.32 wheel, checked against its own functions by
# tests/test_real_nccl.py). NCCL <= 2.22 used DJB2a instead: see docs/communicators.md.
_EAT_MUL0 = 0x9DE62BBC8CEF3CE3
_EAT_MUL1 = 0x485CD6311B599E79
_DIGEST_MUL0 = 0xBAC3BD562846DE6B
_DIGEST_MUL1 = 0x995A187A14E7B445


def nccl_eat(acc: list[int], data: bytes) -> None:
    """Absorb `data` into the two-word state `acc`: the length first, then one
    round per 8-byte little-endian chunk (the last one zero-filled)."""
    a0, a1 = acc[0] ^ len(data), acc[1]
    for off in range(0, len(data), 8):
        a0 = (a0 + a1) & MASK64
        a1 ^= a0
        a0 = ((a0 ^ (a0 >> 31)) * _EAT_MUL0) & MASK64
        a1 = ((a1 ^ (a1 >> 32)) * _EAT_MUL1) & MASK64
        a0 = (a0 + int.from_bytes(data[off:off + 8], "little")) & MASK64
    acc[0], acc[1] = a0, a1


def nccl_digest(acc: list[int]) -> int:
    h = ((acc[0] ^ (acc[0] >> 31)) * _DIGEST_MUL0) & MASK64
    h = (h + acc[1]) & MASK64
    return ((h ^ (h >> 32)) * _DIGEST_MUL1) & MASK64


def nccl_comm_hash(unique_id: bytes) -> int:
    """NCCL's own commHash of a root communicator: getHash(commId->internal, 128),
    i.e. eat all 128 bytes into the state {1, 1}, then digest."""
    _check_len(unique_id)
    acc = [1, 1]
    nccl_eat(acc, unique_id)
    return nccl_digest(acc)


def split_nccl_comm_hash(parent_nccl_hash: int, split_count: int, color: int) -> int:
    """NCCL's commHash of a communicator made by ncclCommSplit: the parent's
    commHash (u64), the parent's split counter after this split (int: 1 for the
    first ncclCommSplit on that parent) and the color (int), eaten in that order."""
    acc = [1, 1]
    nccl_eat(acc, struct.pack("<Q", parent_nccl_hash & MASK64))
    nccl_eat(acc, struct.pack("<I", split_count & 0xFFFFFFFF))
    nccl_eat(acc, struct.pack("<I", color & 0xFFFFFFFF))
    return nccl_digest(acc)


def split_agent_comm_hash(parent_hash: int, color: int, split_seq: int) -> int:
    """Identity of the child made by the split_seq-th ncclCommSplit on a parent.

    Every rank of the parent calls ncclCommSplit the same number of times (it
    is collective), so (parent, sequence, color) is equal on every rank that
    lands in the same child, with no communication between agents.
    """
    mixed = splitmix64(parent_hash ^ SPLIT_TAG)
    return splitmix64(mixed ^ (((split_seq & 0xFFFFFFFF) << 32) | (color & 0xFFFFFFFF)))


SHRINK_TAG = 0x5348524E4B434F4D  # "SHRNKCOM" (bpf/nccl.c SHRINK_TAG)
GROW_TAG = 0x47524F57434F4D4D    # "GROWCOMM" (bpf/nccl.c GROW_TAG)


def shrink_agent_comm_hash(parent_hash: int, seq: int) -> int:
    """Our id of the child of the seq-th (from 0) ncclCommShrink/ncclCommGrow on
    a parent in this process: equal on every surviving rank, as for a split."""
    return splitmix64(splitmix64(parent_hash ^ SHRINK_TAG) ^ ((seq << 32) & MASK64))


def shrink_nccl_comm_hash(parent_nccl_hash: int) -> int:
    """NCCL's commHash of a shrink child: a split with count 0 and color 0."""
    return split_nccl_comm_hash(parent_nccl_hash, 0, 0)


def grow_agent_comm_hash(parent_hash: int, seq: int) -> int:
    """Our id of a grown communicator on an existing rank (from its parent)."""
    return splitmix64(splitmix64(parent_hash ^ GROW_TAG) ^ ((seq << 32) & MASK64))


def grow_new_rank_agent_comm_hash(unique_id: bytes) -> int:
    """Our id of a grown communicator on a new rank (from the id it joined with)."""
    return splitmix64(agent_comm_hash(unique_id) ^ GROW_TAG)


def format_hash(h: int) -> str:
    return f"{h & MASK64:016x}"


def _check_len(unique_id: bytes) -> None:
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"a ncclUniqueId is {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
