"""The on-disk format of a segment: several KV blocks in one file, written once, never changed.

Layout (little-endian)::

    header    16 bytes
        magic     4s  b"EKVS"
        version   u16 FORMAT_VERSION
        count     u16 blocks in the segment, 1 to MAX_BLOCKS
        checksum  u64 XXH3-64 of the table, seeded with count
    table     one entry per block, in payload order
        key_len   u8  1 to MAX_KEY_BYTES
        key       key_len bytes
        checksum  u64 XXH3-64 of the block's payload
    payloads  count blocks of the spec's block bytes, back to back

A payload is the block tensor's memory as bytes (canonical layout, the spec's dtype, native
byte order). A table whose header or checksum does not match makes the whole segment
corrupt; a payload is served only when its checksum agrees, so damage to one payload costs
that block alone.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import xxhash

MAGIC = b"EKVS"
FORMAT_VERSION = 2  # 1 was one file per block
HEADER = struct.Struct("<4sHHQ")
HEADER_SIZE = HEADER.size
MAX_BLOCKS = 2**16 - 1
MAX_KEY_BYTES = 64
SUFFIX = ".kvs"


class CorruptSegmentError(Exception):
    """A segment whose header or table cannot be trusted: none of its blocks can be found."""


class CorruptBlockError(Exception):
    """A payload that is cut short or fails its checksum."""


class TableEntry(NamedTuple):
    key: bytes
    offset: int  # of the payload in the file
    checksum: int  # of the payload


def valid_key(key: Any) -> bool:
    """A table entry holds 1 to ``MAX_KEY_BYTES`` bytes of key; anything else is refused."""
    return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES


def entry_size(key_bytes: int) -> int:
    """Bytes of a table entry for a key of ``key_bytes`` bytes."""
    return 1 + key_bytes + 8


def checksum(payload: Any) -> int:
    """XXH3-64 of a contiguous byte buffer: about 30 GB/s here, and it releases the GIL, so that
    checksumming a block costs far less than writing or reading it."""
    return xxhash.xxh3_64_intdigest(payload)


def encode(keys: Sequence[bytes], payloads: Sequence[Any]) -> tuple[bytes, list[TableEntry]]:
    """The header and table of a segment holding ``payloads`` (equal-sized contiguous byte
    buffers) under ``keys``, and each block's entry: the payloads follow the returned bytes."""
    table = bytearray()
    sums = [checksum(payload) for payload in payloads]
    for key, payload_checksum in zip(keys, sums, strict=True):
        table += struct.pack("<B", len(key)) + key + struct.pack("<Q", payload_checksum)
    entries, offset = [], HEADER_SIZE + len(table)
    for key, payload, payload_checksum in zip(keys, payloads, sums):
        entries.append(TableEntry(key, offset, payload_checksum))
        offset += memoryview(payload).nbytes
    header = HEADER.pack(MAGIC, FORMAT_VERSION, len(keys), xxhash.xxh3_64_intdigest(table, seed=len(keys)))
    return header + table, entries


def read_table(path: str, block_bytes: int) -> list[TableEntry]:
    """Every block entry of the segment at ``path`` (whether or not its payload lies within the
    file). Raises :class:`CorruptSegmentError` for a header or table that does not check out and
    ``OSError`` when the file cannot be read."""
    with open(path, "rb", buffering=0, opener=_open_no_follow) as file:
        header = file.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise CorruptSegmentError(f"{path}: truncated header ({len(header)} of {HEADER_SIZE} bytes)")
        magic, version, count, expected = HEADER.unpack(header)
        if magic != MAGIC:
            raise CorruptSegmentError(f"{path}: bad magic {magic!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise CorruptSegmentError(f"{path}: format version {version}, this tier reads {FORMAT_VERSION}")
        if count == 0:
            raise CorruptSegmentError(f"{path}: a header of no blocks")
        table = file.read(count * entry_size(MAX_KEY_BYTES))  # at most this long; payloads follow
    keys, sums, pos = [], [], 0
    for _ in range(count):
        key_bytes = table[pos] if pos < len(table) else 0
        end = pos + entry_size(key_bytes)
        if not 0 < key_bytes <= MAX_KEY_BYTES or end > len(table):
            raise CorruptSegmentError(f"{path}: table entry {len(keys)} of {count} is malformed or cut short")
        keys.append(table[pos + 1 : end - 8])
        sums.append(struct.unpack_from("<Q", table, end - 8)[0])
        pos = end
    if xxhash.xxh3_64_intdigest(table[:pos], seed=count) != expected:
        raise CorruptSegmentError(f"{path}: table checksum mismatch")
    start = HEADER_SIZE + pos
    return [TableEntry(key, start + i * block_bytes, s) for i, (key, s) in enumerate(zip(keys, sums))]


def read_block(path: str, entry: TableEntry, into: memoryview) -> None:
    """Fill ``into`` (a writable contiguous byte buffer of the block's size) with the payload of
    ``entry`` in the segment at ``path``. Raises :class:`CorruptBlockError` for a payload cut
    short or failing its checksum (``into`` is then partly overwritten) and ``OSError`` when the
    file cannot be read (``FileNotFoundError`` when it is gone; a symbolic link is refused)."""
    fd = _open_no_follow(path, os.O_RDONLY)
    try:
        total = 0
        while total < into.nbytes:
            n = os.preadv(fd, [into[total:]], entry.offset + total)
            if not n:
                raise CorruptBlockError(f"{path}: payload at {entry.offset} cut short ({total} of {into.nbytes} bytes)")
            total += n
    finally:
        os.close(fd)
    if checksum(into) != entry.checksum:
        raise CorruptBlockError(f"{path}: checksum mismatch for the payload at {entry.offset}")


def _open_no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
