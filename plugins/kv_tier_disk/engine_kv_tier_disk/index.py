"""Which segment holds each block, and the segments in least-recently-used order.

Eviction goes by segment: a segment leaves the index whole, and a use of any of its blocks
makes all of them the most recently used; a segment written anew without its damaged blocks
takes the old one's place. Not thread-safe: the tier holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from engine_kv_tier_disk.segment import TableEntry


@dataclass(eq=False)
class Segment:
    path: str
    size: int  # bytes on disk
    keys: set[bytes] = field(default_factory=set)  # the blocks the index serves from it


class Entry(NamedTuple):
    segment: Segment
    block: TableEntry


class SegmentIndex:
    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._segments: OrderedDict[Segment, None] = OrderedDict()  # least recently used first
        self.used_bytes = 0  # sizes of the indexed segments

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def add(self, path: str, size: int, blocks: Iterable[TableEntry]) -> list[Segment]:
        """Index the segment at ``path`` as the most recently used. Its blocks replace other
        copies of their keys. Returns the segments left holding no block (this one included,
        when ``blocks`` is empty): they are out of the index, and their files are garbage."""
        segment = Segment(path, size)
        emptied = []
        for block in blocks:
            old = self._entries.get(block.key)
            if old is not None and old.segment is not segment:
                old.segment.keys.discard(block.key)
                if not old.segment.keys:
                    self._forget(old.segment)
                    emptied.append(old.segment)
            self._entries[block.key] = Entry(segment, block)
            segment.keys.add(block.key)
        if segment.keys:
            self._segments[segment] = None
            self.used_bytes += size
        else:
            emptied.append(segment)
        return emptied

    def holds(self, segment: Segment) -> bool:
        """Whether ``segment`` is still in the index (not evicted, dropped or replaced)."""
        return segment in self._segments

    def replace(self, old: Segment, path: str, size: int, blocks: Iterable[TableEntry]) -> Segment | None:
        """Index the segment at ``path`` in the place of ``old`` in the least-recently-used order,
        serving those of ``blocks`` whose keys ``old`` still serves; ``old``'s other keys leave the
        index with it. Returns the new segment, or ``None`` when ``old`` had left the index or none
        of its keys is among ``blocks`` (then the new file is garbage)."""
        if old not in self._segments:
            return None
        new = Segment(path, size)
        for block in blocks:
            if block.key in old.keys:
                self._entries[block.key] = Entry(new, block)
                new.keys.add(block.key)
        for key in old.keys - new.keys:
            del self._entries[key]
        if not new.keys:
            self._forget(old)
            return None
        self._segments = OrderedDict((new if segment is old else segment, None) for segment in self._segments)
        self.used_bytes += size - old.size
        return new

    def use(self, segment: Segment) -> bool:
        """Make ``segment`` the most recently used; False when it already was, or has left."""
        if segment not in self._segments or next(reversed(self._segments)) is segment:
            return False
        self._segments.move_to_end(segment)
        return True

    def evict(self) -> Segment | None:
        """Remove the least recently used segment and its blocks; ``None`` when there is none."""
        if not self._segments:
            return None
        segment = next(iter(self._segments))
        self.drop_segment(segment)
        return segment

    def drop_block(self, key: bytes, entry: Entry) -> bool:
        """Forget ``key`` if ``entry`` is still what it names; a segment left without blocks
        leaves the index too (its ``keys`` are then empty). False when there was nothing to drop."""
        if self._entries.get(key) != entry:
            return False
        del self._entries[key]
        entry.segment.keys.discard(key)
        if not entry.segment.keys:
            self._forget(entry.segment)
        return True

    def drop_segment(self, segment: Segment) -> int:
        """Forget ``segment`` and its blocks; how many blocks that was (0 when it had left)."""
        if segment not in self._segments:
            return 0
        for key in segment.keys:
            del self._entries[key]
        self._forget(segment)
        return len(segment.keys)

    def _forget(self, segment: Segment) -> None:
        del self._segments[segment]
        self.used_bytes -= segment.size
