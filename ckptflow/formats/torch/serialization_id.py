"""The `.data/serialization_id` record of a torch archive, computed exactly as torch computes it.

torch's `PyTorchStreamWriter` (caffe2/serialize/inline_container.cc) writes, as its last record, 40
decimal digits derived from what it wrote before: 20 for a combined hash of the record names, 20 for a
combined hash of the records' CRC-32s. Nothing random goes in, so `torch.save` of the same object
gives the same file every time, and so does `formats.torch.writer`: an archive written twice, on threads
or on a cluster, is byte for byte the same, and byte for byte what torch writes.

The parts, as torch builds them (checked against torch 2.13's own output for 0 to 5,100 storages):

- names: the record names without the archive prefix ("data.pkl", "data/0", "version"), in the
  iteration order of the `std::unordered_set<std::string>` torch keeps them in (libstdc++'s hashtable:
  `std::hash` is `_Hash_bytes` with seed 0xc70f6907, a new node goes to the front of its bucket or of
  the list, buckets grow along `_Prime_rehash_policy`'s primes), each hash folded in with
  `c10::hash_combine`;
- CRCs: every record's CRC-32 in write order, folded in with `c10::hash_combine`.
"""

from __future__ import annotations

from collections.abc import Sequence

_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_SEED = 0xC70F6907

# (elements after which the table grows, buckets it grows to), from libstdc++'s `_Prime_rehash_policy`
# (max load factor 1.0) for a table filled one element at a time; the prime list goes on beyond.
_GROWTH = ((1, 13), (14, 29), (30, 59), (60, 127), (128, 257), (258, 541), (542, 1109), (1110, 2357),
           (2358, 5087), (5088, 10273), (10274, 20753), (20754, 42043), (42044, 85229), (85230, 172933),
           (172934, 351061), (351062, 712697), (712698, 1447153), (1447154, 2938679))
_GROWS_AT = dict(_GROWTH)


def std_hash(data: bytes) -> int:
    """libstdc++'s `std::hash<std::string>` on a 64-bit machine (`_Hash_bytes`, a MurmurHash2 variant)."""
    n = len(data)
    aligned = n & ~7
    h = (_SEED ^ (n * _MUL)) & _MASK
    for p in range(0, aligned, 8):
        k = (int.from_bytes(data[p:p + 8], "little") * _MUL) & _MASK
        h ^= ((k ^ (k >> 47)) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _MASK
    h = ((h ^ (h >> 47)) * _MUL) & _MASK
    return h ^ (h >> 47)


def hash_combine(seed: int, value: int) -> int:
    """`c10::hash_combine` on 64-bit values."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK) + (seed >> 2)) & _MASK)) & _MASK


def unordered_set_order(hashes: Sequence[int]) -> list[int]:
    """Positions of distinct elements (given by their hashes, inserted in this order) in the order a
    libstdc++ `std::unordered_set` iterates them."""
    nxt: dict[int, int | None] = {}
    head: int | None = None  # the list starts after `_M_before_begin` (-1 in the bucket table)
    buckets: dict[int, int] = {}
    n_buckets = 1

    def link(node: int, table: dict[int, int], count: int) -> None:
        nonlocal head
        bucket = hashes[node] % count
        before = table.get(bucket)
        if before is None:  # an empty bucket: the node goes to the front of the whole list
            nxt[node] = head
            head = node
            after = nxt[node]
            if after is not None:
                table[hashes[after] % count] = node
            table[bucket] = -1
        elif before == -1:
            nxt[node] = head
            head = node
        else:
            nxt[node] = nxt[before]
            nxt[before] = node

    if len(hashes) > _GROWTH[-1][1]:
        raise ValueError(f"{len(hashes)} records: more than the serialization id's growth table covers")
    for i in range(len(hashes)):
        grown = _GROWS_AT.get(i + 1)
        if grown is not None:  # rehash: walk the old list, relinking each node into the new table
            node, head, table, first = head, None, {}, 0
            while node is not None:
                following = nxt[node]
                bucket = hashes[node] % grown
                if bucket not in table:
                    nxt[node] = head
                    head = node
                    table[bucket] = -1
                    if nxt[node] is not None:
                        table[first] = node
                    first = bucket
                else:
                    before = table[bucket]
                    if before == -1:
                        nxt[node] = head
                        head = node
                    else:
                        nxt[node] = nxt[before]
                        nxt[before] = node
                node = following
            buckets, n_buckets = table, grown
        link(i, buckets, n_buckets)
    order = []
    node = head
    while node is not None:
        order.append(node)
        node = nxt[node]
    return order


def serialization_id(records: Sequence[tuple[str, int]]) -> str:
    """The id torch writes after `records`: (name without the archive prefix, CRC-32), in write order."""
    names: list[str] = []
    seen: set[str] = set()
    for name, _crc in records:
        if name not in seen:
            seen.add(name)
            names.append(name)
    hashes = [std_hash(name.encode("utf-8")) for name in names]
    name_hash = 0
    for i in unordered_set_order(hashes):
        name_hash = hash_combine(name_hash, hashes[i])
    crc_hash = 0
    for _name, crc in records:
        crc_hash = hash_combine(crc_hash, crc)
    return f"{name_hash:020d}{crc_hash:020d}"
