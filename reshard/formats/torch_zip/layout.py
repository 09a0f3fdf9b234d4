"""The bytes of the zip archive ``torch.save`` writes, computed from record names and sizes alone.

``torch.save`` writes through ``caffe2/serialize/inline_container.cc`` (``PyTorchStreamWriter``), which
stores each record uncompressed with miniz (``third_party/miniz-3.0.2``, built without timestamps). What
that gives, and what this module reproduces byte for byte:

* each record: a local header (version 0, flags ``0x0808``: a data descriptor follows and names are
  UTF-8; time, CRC and sizes zero), ``<archive>/<name>``, a zip64 extra field when the size or the
  header's offset reaches 4 GiB, then an ``FB`` extra field padded with ``Z`` so that the data starts
  on a multiple of the storage alignment (64); the data; a data descriptor (``PK\\x07\\x08``, CRC-32,
  sizes; 64-bit sizes when the local header had a zip64 field). An empty record has flags ``0x0800``
  and no descriptor;
* the central directory (no ``FB`` fields; zip64 fields as in the local headers, with real sizes),
  then a zip64 end record and locator (always), then the end record;
* ``.data/serialization_id``: 20 digits of a combined hash of the record names, 20 of a combined hash
  of the records' CRCs (see :func:`serialization_id`).

Offsets follow from sizes alone, so a file can be laid out before any tensor's bytes exist.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
SERIALIZATION_ID = ".data/serialization_id"


@dataclass
class Record:
    """One record of the archive: where its parts go. ``crc`` is set once its bytes are known."""

    name: str
    size: int
    header_offset: int
    header: bytes  # local header, full name, zip64 field, FB padding
    crc: int = field(default=0)

    @property
    def zip64(self) -> bool:
        return self.size >= U32 or self.header_offset >= U32

    @property
    def data_offset(self) -> int:
        return self.header_offset + len(self.header)

    @property
    def end(self) -> int:
        """The offset after its data descriptor."""
        return self.data_offset + self.size + descriptor_size(self.size, zip64=self.zip64)

    def descriptor(self) -> bytes:
        """The data descriptor written after the data (nothing for an empty record)."""
        if not self.size:
            return b""
        if self.zip64:
            return struct.pack("<IIQQ", 0x08074B50, self.crc, self.size, self.size)
        return struct.pack("<IIII", 0x08074B50, self.crc, self.size, self.size)

    def central(self, prefix: bytes) -> bytes:
        """Its central directory entry."""
        name = prefix + self.name.encode()
        extra = _zip64_field(self.size, self.size, self.header_offset)
        fixed = _CENTRAL.pack(
            0x02014B50, 0, 0, _flags(self.size), 0, 0, 0, self.crc, min(self.size, U32), min(self.size, U32),
            len(name), len(extra), 0, 0, 0, 0, min(self.header_offset, U32),
        )  # fmt: skip
        return fixed + name + extra


def descriptor_size(size: int, *, zip64: bool) -> int:
    return 0 if not size else 24 if zip64 else 16


def _flags(size: int) -> int:
    return 0x0808 if size else 0x0800  # bit 3: sizes and CRC in a data descriptor; bit 11: UTF-8 names


def _zip64_field(size: int, compressed: int, offset: int) -> bytes:
    """miniz's zip64 extended information field: sizes when the size reaches 4 GiB, the offset when it does."""
    values = ([size, compressed] if size >= U32 else []) + ([offset] if offset >= U32 else [])
    if not values:
        return b""
    return struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values)


def local_record(prefix: bytes, name: str, size: int, offset: int, alignment: int) -> Record:
    """The record of ``size`` bytes whose local header starts at ``offset`` (as miniz writes it)."""
    full = prefix + name.encode()
    # miniz writes the compressed size as 0 here: the data is not written yet when the header is.
    zip64 = _zip64_field(size, 0, offset)
    start = offset + _LOCAL.size + len(full) + len(zip64) + 4
    padding = -start % alignment
    extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
    header = _LOCAL.pack(0x04034B50, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra
    return Record(name, size, offset, header)


def layout(prefix: bytes, records: Sequence[tuple[str, int]], alignment: int, start: int = 0) -> list[Record]:
    """Records of the given names and sizes laid out one after another from ``start``."""
    out = []
    for name, size in records:
        record = local_record(prefix, name, size, start, alignment)
        out.append(record)
        start = record.end
    return out


def directory(prefix: bytes, records: Sequence[Record]) -> bytes:
    """The central directory, zip64 end record and locator, and end record, after the last record."""
    offset = records[-1].end if records else 0
    central = b"".join(record.central(prefix) for record in records)
    count, end64 = len(records), offset + len(central)
    return (
        central
        + _ZIP64_END.pack(0x06064B50, _ZIP64_END.size - 12, 0x031E, 0x002D, 0, 0, count, count, len(central), offset)
        + _ZIP64_LOCATOR.pack(0x07064B50, 0, end64, 1)
        + _END.pack(0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF), min(len(central), U32),
                    min(offset, U32), 0)
    )  # fmt: skip


def directory_size(prefix: bytes, records: Sequence[Record]) -> int:
    """The bytes :func:`directory` takes (it does not depend on the CRCs)."""
    names = sum(46 + len(prefix) + len(r.name.encode()) + len(_zip64_field(r.size, r.size, r.header_offset))
                for r in records)  # fmt: skip
    return names + _ZIP64_END.size + _ZIP64_LOCATOR.size + _END.size


# ---------------------------------------------------------------- .data/serialization_id


def serialization_id(records: Sequence[Record]) -> str:
    """What ``PyTorchStreamWriter::writeSerializationId`` computes for the records written so far.

    The first 20 digits fold ``c10::hash_combine`` over ``std::hash`` of each record name, in the
    iteration order of the ``std::unordered_set`` the names were inserted into (libstdc++'s, which
    torch's Linux wheels use); the last 20 fold it over the CRC of every data descriptor, in file order.
    """
    names = 0
    for name in _unordered_set_order([r.name for r in records]):
        names = _hash_combine(names, _hash_bytes(name.encode()))
    crcs = 0
    for record in records:
        if record.size:  # an empty record has no descriptor, and torch takes CRCs from descriptors
            crcs = _hash_combine(crcs, record.crc)
    return f"{names:020d}{crcs:020d}"


def _hash_combine(seed: int, value: int) -> int:
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _U64)) & _U64


_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def _shift_mix(value: int) -> int:
    return value ^ (value >> 47)


def _hash_bytes(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s ``std::_Hash_bytes`` on 64-bit (``std::hash<std::string>``)."""
    tail = len(data) & ~7
    value = (seed ^ (len(data) * _MUL)) & _U64
    for (word,) in struct.iter_unpack("<Q", data[:tail]):
        value = ((value ^ ((_shift_mix((word * _MUL) & _U64) * _MUL) & _U64)) * _MUL) & _U64
    if len(data) & 7:
        value = ((value ^ int.from_bytes(data[tail:], "little")) * _MUL) & _U64
    return _shift_mix((_shift_mix(value) * _MUL) & _U64)


# libstdc++'s bucket counts (hashtable_c++0x.cc: __fast_bkt, then hashtable-aux.cc: __prime_list from 17 on).
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)
_PRIMES = (
    17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103, 109, 113, 127, 137, 139, 149,
    157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313, 337, 359, 383, 409, 439, 467, 503, 541, 577, 619,
    661, 709, 761, 823, 887, 953, 1031, 1109, 1193, 1289, 1381, 1493, 1613, 1741, 1879, 2029, 2179, 2357, 2549,
    2753, 2971, 3209, 3469, 3739, 4027, 4349, 4703, 5087, 5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273,
    11113, 12011, 12983, 14033, 15173, 16411, 17749, 19183, 20753, 22447, 24281, 26267, 28411, 30727, 33223, 35933,
    38873, 42043, 45481, 49201, 53201, 57557, 62233, 67307, 72817, 78779, 85229, 92203, 99733, 107897, 116731,
    126271, 136607, 147793, 159871, 172933, 187091, 202409, 218971, 236897, 256279, 277261, 299951, 324503, 351061,
    379787, 410857, 444487, 480881, 520241, 562841, 608903, 658753, 712697, 771049, 834181, 902483, 976369, 1056323,
    1142821, 1236397, 1337629, 1447153, 1565659, 1693859, 1832561, 1982627, 2144977, 2320627, 2510653, 2716249,
)  # fmt: skip


def _bucket_count(wanted: int) -> int:
    """``_Prime_rehash_policy::_M_next_bkt``: the bucket count for at least ``wanted`` buckets."""
    if wanted < len(_FAST_BUCKETS):
        return _FAST_BUCKETS[wanted]
    index = bisect.bisect_left(_PRIMES, wanted)
    if index == len(_PRIMES):
        raise ValueError(f"{wanted} buckets: more records than this table of libstdc++'s bucket counts covers")
    return _PRIMES[index]


def _unordered_set_order(names: Sequence[str]) -> list[str]:
    """The order a libstdc++ ``std::unordered_set<std::string>`` iterates ``names`` inserted in this order.

    Its nodes form one singly linked list; a bucket points at the node before its first one. A node whose
    bucket is empty goes to the front of the list, else to the front of its bucket's run; growing the
    table (max load factor 1, at least doubling, to the next bucket count of the table) relinks every
    node in list order by the same rule.
    """
    codes = [_hash_bytes(name.encode()) for name in names]
    head = -1  # the list's "before begin" node
    after: dict[int, int | None] = {head: None}
    buckets: list[int | None] = [None]
    resize_at = 0

    def link(node: int, table: list[int | None], begin_bucket: list[int]) -> None:
        bucket = codes[node] % len(table)
        before = table[bucket]
        if before is not None:
            after[node], after[before] = after[before], node
            return
        after[node], after[head] = after[head], node
        if after[node] is not None:
            table[begin_bucket[0]] = node
        table[bucket] = head
        begin_bucket[0] = bucket

    for node in range(len(codes)):
        if node + 1 > resize_at:  # _M_need_rehash with one insertion
            wanted = max(node + 1, 0 if resize_at else 11)
            if wanted >= len(buckets):
                table: list[int | None] = [None] * _bucket_count(max(wanted + 1, 2 * len(buckets)))
                resize_at = len(table)
                walk, after[head] = after[head], None
                begin = [0]
                while walk is not None:
                    following = after[walk]
                    link(walk, table, begin)
                    walk = following
                buckets = table
            else:
                resize_at = len(buckets)
        first = after[head]
        begin = [codes[first] % len(buckets)] if first is not None else [0]
        link(node, buckets, begin)
    order, walk = [], after[head]
    while walk is not None:
        order.append(names[walk])
        walk = after[walk]
    return order
