"""The on-disk format of one KV block: a fixed header, then the block's raw bytes.

Header (24 bytes, little-endian)::

    magic    4s  b"EKVB"
    version  u16 FORMAT_VERSION
    flags    u16 0 (reserved)
    length   u64 payload bytes that follow the header
    checksum u64 XXH3-64 of the payload (xxhash.xxh3_64_intdigest)

The payload is the block tensor's memory as bytes (canonical layout, the spec's
dtype, native byte order). A file is valid only when its header matches, its size is
exactly header plus ``length`` and the checksum agrees; anything else is corrupt.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

import xxhash

MAGIC = b"EKVB"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQQ")
HEADER_SIZE = HEADER.size
SUFFIX = ".kvb"


class CorruptBlockError(Exception):
    """A block file whose contents cannot be trusted (bad header, wrong size or checksum)."""


def encode_header(payload: memoryview) -> bytes:
    """The header for ``payload`` (a contiguous byte buffer)."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, 0, payload.nbytes, checksum(payload))


def checksum(payload: memoryview) -> int:
    """XXH3-64 of the payload: about 60 GB/s here against 4 for zlib's crc32, so that
    verifying a block costs far less than reading it."""
    return xxhash.xxh3_64_intdigest(payload)


def read_block(path: str, into: memoryview) -> None:
    """Fill ``into`` (a writable contiguous byte buffer of the expected payload size) from the
    block file at ``path``. Raises :class:`CorruptBlockError` for a file that is not a valid
    block of that size (``into`` is then partly overwritten) and ``OSError`` when the file
    cannot be read (``FileNotFoundError`` when it is gone; a symbolic link is refused)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with open(fd, "rb", buffering=0) as file:
        header = bytearray(HEADER_SIZE)
        got = _read_exactly(file, memoryview(header))
        if got < HEADER_SIZE:
            raise CorruptBlockError(f"{path}: truncated header ({got} of {HEADER_SIZE} bytes)")
        magic, version, _flags, length, expected = HEADER.unpack(header)
        if magic != MAGIC:
            raise CorruptBlockError(f"{path}: bad magic {magic!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise CorruptBlockError(f"{path}: format version {version}, this tier reads {FORMAT_VERSION}")
        if length != into.nbytes:
            raise CorruptBlockError(f"{path}: payload of {length} bytes, expected {into.nbytes}")
        got = _read_exactly(file, into)
        if got < length:
            raise CorruptBlockError(f"{path}: truncated payload ({got} of {length} bytes)")
        if file.read(1):
            raise CorruptBlockError(f"{path}: trailing bytes after the {length}-byte payload")
        if checksum(into) != expected:
            raise CorruptBlockError(f"{path}: checksum mismatch")


def _read_exactly(file: BinaryIO, into: memoryview) -> int:
    """Read into ``into`` until it is full or the file ends; the number of bytes read."""
    total = 0
    while total < into.nbytes:
        n = file.readinto(into[total:])
        if not n:
            break
        total += n
    return total
