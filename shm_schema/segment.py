"""Creating, attaching to and removing the shared segment; validating its header.

posix_ipc, not `multiprocessing.shared_memory`: the stdlib resource tracker unlinks a segment
that a process merely attached to. The segment outlives any one process on purpose: a
restarted sidecar re-attaches and keeps the live counters. It is removed only when the whole
service stops (the launcher, or `python -m cacheroute_proxy shm unlink`).
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import struct
import time
from typing import Callable

import posix_ipc

from . import layout
from .atomic import AtomicView, open_view
from .bitfields import CounterWord
from .records import HEADER


class SegmentError(RuntimeError):
    """The segment cannot be used; the message says why and what to do."""


class SegmentLayoutError(SegmentError):
    pass


class SegmentNotFound(SegmentError):
    pass


def _remedy(name: str) -> str:
    return (f"stop every process using it, then remove it with `make clean-shm` "
            f"(or `python -m cacheroute_proxy shm unlink --name {name}`)")


class Segment:
    """One mapped segment: its geometry, a raw memoryview and an atomic view over it."""

    def __init__(self, name: str, mapping: mmap.mmap, inode: int, created: bool) -> None:
        self.name = name
        self.created = created
        self.inode = inode
        self._mmap = mapping
        self.buf = memoryview(mapping)
        self.atomic: AtomicView = open_view(self.buf)
        self._closers: list[Callable[[], None]] = []
        self._check_header()
        self.geometry = layout.Geometry(self.load(layout.H_INSTANCE_CAPACITY),
                                        self.load(layout.H_WORKER_CAPACITY),
                                        self.load(layout.H_RING_CAPACITY))
        self.creation_id = self.load(layout.H_CREATION_ID)

    # --- lifecycle ----------------------------------------------------------------------
    @classmethod
    def create_or_attach(cls, name: str, instance_capacity: int, worker_capacity: int,
                         ring_capacity: int = layout.DEFAULT_RING_CAPACITY) -> "Segment":
        """For the sidecar: attach to a live segment, or create and initialise a new one."""
        geometry = layout.Geometry(instance_capacity, worker_capacity, ring_capacity)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError:
            return cls.attach(name)
        except posix_ipc.PermissionsError as exc:
            raise SegmentError(f"cannot create shared memory {name}: {exc}") from None
        try:
            _reserve(shm, geometry.total_size, name)
            mapping = mmap.mmap(shm.fd, geometry.total_size)
            inode = os.fstat(shm.fd).st_ino
        except BaseException:
            shm.close_fd()
            _unlink_quietly(name)
            raise
        shm.close_fd()
        _initialise(mapping, geometry)
        return cls(name, mapping, inode, created=True)

    @classmethod
    def attach(cls, name: str, wait_s: float = 0.0) -> "Segment":
        """For workers and tools: attach to an existing segment, never create one."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return cls._attach_once(name)
            except (SegmentNotFound, _NotInitialisedYet):
                if time.monotonic() >= deadline:
                    raise SegmentNotFound(
                        f"shared memory {name} does not exist or is not initialised; "
                        f"start the sidecar first (it creates the segment)") from None
                time.sleep(0.05)

    @classmethod
    def _attach_once(cls, name: str) -> "Segment":
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise SegmentNotFound(name) from None
        except posix_ipc.PermissionsError:
            raise SegmentError(
                f"shared memory {name} exists but belongs to another user or has other "
                f"permissions (/dev/shm{name}); run as its owner, or {_remedy(name)}") from None
        try:
            size = shm.size  # read before close_fd(): .size fstat()s the descriptor
            inode = os.fstat(shm.fd).st_ino
            if size < layout.HEADER_SIZE:
                raise _NotInitialisedYet()
            mapping = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        magic = struct.unpack_from("@Q", mapping, layout.H_MAGIC)[0]
        if magic == 0:
            mapping.close()
            raise _NotInitialisedYet()
        return cls(name, mapping, inode, created=False)

    def _check_header(self) -> None:
        header = HEADER.unpack_from(self.buf)
        if header.magic != layout.MAGIC:
            self.close()
            raise SegmentLayoutError(
                f"shared memory {self.name} is not a CacheRoute load table (magic {header.magic:#x}); "
                f"{_remedy(self.name)}")
        if header.layout_version != layout.LAYOUT_VERSION:
            self.close()
            raise SegmentLayoutError(
                f"shared memory {self.name} has layout version {header.layout_version}, but this "
                f"build uses layout version {layout.LAYOUT_VERSION}; {_remedy(self.name)}")
        inst_cap, worker_cap, size = header.instance_capacity, header.worker_capacity, header.total_size
        expected = layout.Geometry(inst_cap, worker_cap, header.ring_capacity).total_size
        mapped = len(self.buf)
        if size != expected or mapped < expected:
            self.close()
            raise SegmentLayoutError(
                f"shared memory {self.name} is damaged: header says {size} bytes for capacities "
                f"{inst_cap}/{worker_cap} (expected {expected}), mapping has {mapped}; "
                f"{_remedy(self.name)}")

    def is_current(self) -> bool:
        """False if the name now points at another segment (unlinked and created again)."""
        try:
            return os.stat(f"/dev/shm{self.name}").st_ino == self.inode
        except FileNotFoundError:
            return False

    def on_close(self, release: Callable[[], None]) -> None:
        """Call `release` first when the segment closes: something that holds its buffer."""
        self._closers.append(release)

    def close(self) -> None:
        for release in getattr(self, "_closers", ()):
            release()
        atomic = getattr(self, "atomic", None)
        if atomic is not None:
            atomic.close()
        self.buf.release()
        self._mmap.close()

    @staticmethod
    def unlink(name: str) -> bool:
        return _unlink_quietly(name)

    # --- word access ----------------------------------------------------------------------
    def load(self, offset: int) -> int:
        return self.atomic.load_u64(offset)

    def store(self, offset: int, value: int) -> None:
        self.atomic.store_u64(offset, value)

    def fetch_add(self, offset: int, value: int) -> int:
        return self.atomic.fetch_add_u64(offset, value)


class _NotInitialisedYet(Exception):
    pass


def _reserve(shm: posix_ipc.SharedMemory, size: int, name: str) -> None:
    """Size the segment and allocate its pages now, so a full /dev/shm fails here, with a
    message, instead of with SIGBUS on the first write to an unbacked page."""
    os.ftruncate(shm.fd, size)
    try:
        os.posix_fallocate(shm.fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise SegmentError(
                f"/dev/shm has no room for the {size}-byte shared table {name} ({exc.strerror}); "
                f"free space in /dev/shm or lower PROXY_SHM_INSTANCE_CAPACITY / "
                f"PROXY_SHM_WORKER_CAPACITY") from None
        raise


def _initialise(mapping: mmap.mmap, geometry: layout.Geometry) -> None:
    mapping[: geometry.total_size] = bytes(geometry.total_size)
    header = {
        layout.H_LAYOUT_VERSION: layout.LAYOUT_VERSION,
        layout.H_INSTANCE_CAPACITY: geometry.instance_capacity,
        layout.H_WORKER_CAPACITY: geometry.worker_capacity,
        layout.H_RING_CAPACITY: geometry.ring_capacity,
        layout.H_TOTAL_SIZE: geometry.total_size,
        layout.H_CREATION_ID: secrets.randbits(63) | 1,
        layout.H_CREATED_AT_NS: time.time_ns(),
    }
    for offset, value in header.items():
        struct.pack_into("@Q", mapping, offset, value)
    for slot in range(geometry.instance_capacity):
        # Generation 1 for fresh slots: a zero word never matches a live lease.
        struct.pack_into("@Q", mapping, geometry.slot_offset(slot) + layout.S_GENERATION, 1)
        for lane in range(layout.LANES_USED):
            struct.pack_into("@Q", mapping, geometry.counter_offset(slot, lane), CounterWord.pack(1, 0))
    # Magic last: an attacher that sees it sees a fully initialised header.
    raw = memoryview(mapping)
    view = open_view(raw)
    try:
        view.store_u64(layout.H_MAGIC, layout.MAGIC)
    finally:
        view.close()
        raw.release()


def _unlink_quietly(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False
