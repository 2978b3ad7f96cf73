"""A process's metric values, in one memory-mapped file that other processes read.

Not part of the shared segment: each worker owns one file in the metrics directory and is its
only writer; whoever serves a scrape reads every file there and sums them. A worker's request
path adds to float64 words in place (`MetricFile.values[i] += x`: no lock, no syscall, no pid
check, ~0.1 µs), which is why this is not prometheus_client's multiprocess mode (a lock, a pid
check and a struct write per value, 2-5 µs a call).

Byte layout, little-endian, every field 8-aligned:

    header (16 bytes):  magic "CRMV" | u32 version | u64 used (end of the last whole entry)
    entry:              u32 key length | u32 value count | key (UTF-8, zero-padded to 8)
                        | value count x f64

An entry is written whole before `used` moves past it, with one aligned 8-byte store, so a
reader that reads `used` first never parses a half-written entry (x86-64 keeps stores in
order, as prometheus_client's mmap_dict also relies on). A value a reader sees may be one
update old, never torn. A crash between writing an entry and publishing it leaves bytes past
`used` that the next opener overwrites; opening a file that exists (a pid reused after a
crash, or a restart) continues from its values, so totals never go down.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Iterator

__all__ = ["MetricFile", "MetricFileFull", "MetricFileError", "read_metric_file"]

MAGIC = b"CRMV"
VERSION = 1
_HEADER = struct.Struct("<4sIQ")
_EMPTY_HEADER = _HEADER.pack(MAGIC, VERSION, _HEADER.size)  # a file with no entry yet
_USED = struct.Struct("<Q")
_USED_AT = 8
_ENTRY_HEAD = struct.Struct("<II")
_VALUE = 8
DEFAULT_CAPACITY = 4 * 1024 * 1024  # sparse: pages are backed only once written


class MetricFileError(Exception):
    """The file is not a metric values file of this version."""


class MetricFileFull(Exception):
    """No room for another entry."""


def _padded(n: int) -> int:
    return (n + 7) & ~7


def _entries(buf: bytes | mmap.mmap, used: int, path: str) -> Iterator[tuple[bytes, int, int]]:
    """(key, offset of the first value, value count) of each whole entry before `used`; an
    entry that runs past `used` was not written by this module."""
    at = _HEADER.size
    while at < used:
        if at + _ENTRY_HEAD.size > used:
            raise MetricFileError(f"{path}: damaged entry at {at}")
        key_length, count = _ENTRY_HEAD.unpack_from(buf, at)
        key_at = at + _ENTRY_HEAD.size
        values_at = key_at + _padded(key_length)
        end = values_at + count * _VALUE
        if end > used:
            raise MetricFileError(f"{path}: damaged entry at {at} (ends at {end}, past {used})")
        yield bytes(buf[key_at:key_at + key_length]), values_at, count
        at = end


def _check_header(head: bytes, path: str, size: int | None = None) -> int:
    """`used`, once the header is this module's and `used` fits in `size` (when known)."""
    if len(head) < _HEADER.size:
        raise MetricFileError(f"{path}: shorter than a header")
    magic, version, used = _HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise MetricFileError(f"{path}: not a metric values file of version {VERSION}")
    if not _HEADER.size <= used <= (size if size is not None else used):
        raise MetricFileError(f"{path}: its used size {used} is not within the file")
    return used


class MetricFile:
    """The writer's side: `slot(key, width)` finds or adds an entry and returns the index of
    its first value in `values` (a float64 view of the whole file)."""

    def __init__(self, path: str | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
        """A file at `path` (created, or continued if it exists), or with no path an anonymous
        mapping that only this process sees (a worker run without a metrics directory)."""
        self.path = path
        if path is None:
            self._map = mmap.mmap(-1, capacity)
            self._map[:_HEADER.size] = _EMPTY_HEADER
        else:
            self._map = _map_file(path, capacity)
        self._capacity = len(self._map)
        name = path or "<anonymous>"
        try:
            self._used = _check_header(self._map[:_HEADER.size], name, self._capacity)
            self._slots = {key: at // _VALUE for key, at, _ in _entries(self._map, self._used, name)}
        except MetricFileError:
            self._map.close()
            raise
        self.values = memoryview(self._map).cast("d")

    def slot(self, key: bytes, width: int) -> int:
        index = self._slots.get(key)
        if index is None:
            index = self._slots[key] = self._append(key, width)
        return index

    def entries(self) -> list[tuple[bytes, tuple[float, ...]]]:
        """This file's entries with their values, as a reader in another process sees them."""
        return _read(self._map, self._used, self.path or "<anonymous>")

    def close(self) -> None:
        self.values.release()
        self._map.close()

    def _append(self, key: bytes, width: int) -> int:
        at = self._used
        values_at = at + _ENTRY_HEAD.size + _padded(len(key))
        end = values_at + width * _VALUE
        if end > self._capacity:
            raise MetricFileFull(f"{self.path or '<anonymous>'}: {self._capacity} bytes used")
        _ENTRY_HEAD.pack_into(self._map, at, len(key), width)
        self._map[at + _ENTRY_HEAD.size:values_at] = key.ljust(values_at - at - _ENTRY_HEAD.size, b"\0")
        self._map[values_at:end] = bytes(end - values_at)  # bytes a crashed writer left go
        _USED.pack_into(self._map, _USED_AT, end)  # published: a reader may parse it from now
        self._used = end
        return values_at // _VALUE


def _map_file(path: str, capacity: int) -> mmap.mmap:
    """Map the file at `path`; a new one appears whole (header written, then renamed into
    place), so a reader never finds a file without its header."""
    if not os.path.exists(path):
        fresh = f"{path}.new"
        with open(fresh, "wb") as f:
            f.truncate(capacity)
            f.write(_EMPTY_HEADER)
        os.chmod(fresh, 0o600)
        os.rename(fresh, path)
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER.size or size % _VALUE:  # not one of ours (ours are whole words)
            raise MetricFileError(f"{path}: {size} bytes is no metric values file")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _read(buf: bytes | mmap.mmap, used: int, path: str) -> list[tuple[bytes, tuple[float, ...]]]:
    return [(key, struct.unpack_from(f"<{count}d", buf, at)) for key, at, count in _entries(buf, used, path)]


def read_metric_file(path: str) -> list[tuple[bytes, tuple[float, ...]]]:
    """Every whole entry of the file at `path`, with its values. Reads only what is used."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        used = _check_header(head, path, os.fstat(f.fileno()).st_size)
        body = head + f.read(used - _HEADER.size)
    return _read(body, used, path)
