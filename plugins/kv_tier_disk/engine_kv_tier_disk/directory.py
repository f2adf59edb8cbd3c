"""The tier's directory on disk: where each segment's file goes, the lock that keeps one open
tier per directory, and the scan that finds the segments an earlier run left behind.

Layout under ``<path>/<digest>/``: ``.lock``, and ``<n>.kvs`` for each segment, ``n`` a number
in 16 hex digits that grows with every segment written; a segment being written is
``.<n>.kvs.<pid>.<thread>.<i>.tmp`` until it is renamed.
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
from typing import NamedTuple

from engine_kv_tier_disk.segment import SUFFIX

logger = logging.getLogger("engine.kv_tier_disk")

LOCK_FILE = ".lock"
_SEGMENT_FILE = re.compile(rf"([0-9a-f]{{16}}){re.escape(SUFFIX)}")
_temp_ids = count()


class DirectoryInUseError(Exception):
    """Another open tier (in this or another process) holds the directory's lock."""


class FoundSegment(NamedTuple):
    path: str
    number: int
    size: int
    mtime_ns: int


def segment_path(directory: str, number: int) -> str:
    return os.path.join(directory, f"{number:016x}{SUFFIX}")


def temp_path(path: str) -> str:
    """A name next to ``path`` that no other writer, thread or process, uses at the same time."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{os.getpid()}.{threading.get_ident()}.{next(_temp_ids)}.tmp")


def scan(directory: str) -> list[FoundSegment]:
    """The segment files in ``directory``, oldest mtime first. Leftover temporary files (writes
    cut short) are removed; other files are left alone. Raises ``OSError`` when ``directory``
    cannot be read."""
    found = []
    for entry in list(os.scandir(directory)):
        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
            remove(entry.path)
            continue
        match = _SEGMENT_FILE.fullmatch(entry.name)
        if not match:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            found.append(FoundSegment(entry.path, int(match[1], 16), info.st_size, info.st_mtime_ns))
    found.sort(key=lambda segment: (segment.mtime_ns, segment.number))
    return found


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
