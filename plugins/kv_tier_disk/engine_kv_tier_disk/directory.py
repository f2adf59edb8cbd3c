"""The tier's directory on disk: where each block's file goes, the lock that keeps one open tier
per directory, and the scan that finds the blocks an earlier run left behind.

Layout under ``<path>/<digest>/``: ``.lock``, and ``<k[0:2]>/<k>.kvb`` for each key ``k`` in
hex; a file being written is ``<k[0:2]>/.<k>.kvb.<pid>.<thread>.<n>.tmp`` until it is renamed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import threading
import time
from itertools import count
from typing import Any, NamedTuple

from engine_kv_tier_disk.blockfile import SUFFIX

logger = logging.getLogger("engine.kv_tier_disk")

MAX_KEY_BYTES = 64
LOCK_FILE = ".lock"
_BLOCK_FILE = re.compile(rf"(?:[0-9a-f]{{2}}){{1,{MAX_KEY_BYTES}}}{re.escape(SUFFIX)}")
_SHARD_DIR = re.compile(r"[0-9a-f]{2}")
_temp_ids = count()


class DirectoryInUseError(Exception):
    """Another open tier (in this or another process) holds the directory's lock."""


class FoundBlock(NamedTuple):
    key: bytes
    size: int
    mtime_ns: int


def valid_key(key: Any) -> bool:
    """Keys name files only through ``key.hex()``; anything but 1 to 64 bytes is refused."""
    return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES


def block_path(directory: str, key: bytes) -> str:
    name = key.hex()
    return os.path.join(directory, name[:2], name + SUFFIX)


def temp_path(path: str) -> str:
    """A name next to ``path`` that no other writer, thread or process, uses at the same time."""
    shard, name = os.path.split(path)
    return os.path.join(shard, f".{name}.{os.getpid()}.{threading.get_ident()}.{next(_temp_ids)}.tmp")


def scan(directory: str, file_size: int) -> tuple[list[FoundBlock], int]:
    """The block files under ``directory``, oldest mtime first, and how many files of the wrong
    size were removed. Leftover temporary files (writes cut short) are removed; other files are
    left alone. Raises ``OSError`` when ``directory`` cannot be read."""
    found = []
    wrong_size = 0
    shards = [e for e in os.scandir(directory) if _SHARD_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    for shard in shards:
        try:
            entries = list(os.scandir(shard.path))
        except OSError as exc:
            logger.warning("disk KV tier: skipping unreadable %s: %s", shard.path, exc)
            continue
        for entry in entries:
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                remove(entry.path)
                continue
            if not (_BLOCK_FILE.fullmatch(entry.name) and entry.name.startswith(shard.name)):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            if info.st_size != file_size:
                wrong_size += 1
                remove(entry.path)
                continue
            found.append(FoundBlock(bytes.fromhex(entry.name[: -len(SUFFIX)]), info.st_size, info.st_mtime_ns))
    found.sort(key=lambda block: (block.mtime_ns, block.key))
    return found, wrong_size


def lock(directory: str) -> int | None:
    """Take the exclusive lock on ``directory`` and return its file descriptor (closing it
    releases the lock). ``None`` where the lock cannot be had for a reason other than another
    holder (a read-only directory without a lock file, a filesystem without ``flock``); raises
    :class:`DirectoryInUseError` where another holder has it."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY)  # a read-only directory can still be locked
        except OSError as exc:
            logger.warning("disk KV tier: cannot open %s (%s); running without the directory lock", path, exc)
            return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUseError(path) from None
    except OSError as exc:
        os.close(fd)
        logger.warning("disk KV tier: cannot lock %s (%s); running without the directory lock", path, exc)
        return None
    return fd


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.debug("disk KV tier: cannot remove %s: %s", path, exc)


def touch(stamped: list[tuple[str, int]]) -> None:
    """Give each file its stamp (ns) as mtime; a file gone meanwhile is the next load's business."""
    for path, stamp in stamped:
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass


def next_stamp(last: int) -> int:
    """A stamp after ``last`` and no earlier than now, so stamps order uses even across restarts."""
    return max(time.time_ns(), last + 1)
