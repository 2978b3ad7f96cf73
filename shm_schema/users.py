"""The live processes a segment records as using it, by name and whatever its layout: what a
tool asks before it removes the segment (`cacheroute-proxy shm unlink`).

A process that still maps a removed segment serves on from its mapping, but no process started
after it can find that table: the next sidecar or worker creates an empty one. So a segment is
in use while its sidecar lives, or any worker whose row is claimed.

The sidecar is the header's owner word. The header's first words have kept one place and one
packing in every layout so far (magic at 0, layout version at 8, the sidecar's ProcessIdentity
at 64), so the sidecar is found in a segment of another layout too: the one an upgrade leaves
while the old proxy still runs on it. Worker rows are read only in a segment of this layout.
A recorded pid now used by another process does not count (process_identity: pid and start
time).
"""

from __future__ import annotations

import mmap
import struct
from typing import Literal, NamedTuple

import posix_ipc

from . import layout, process_identity
from .bitfields import ProcessIdentity
from .repair import read_rows
from .segment import Segment, SegmentError

_WORD = struct.Struct("@Q")


class SegmentUser(NamedTuple):
    role: Literal["sidecar", "worker"]
    pid: int


class HeaderPrefix(NamedTuple):
    magic: int
    layout_version: int
    sidecar_identity: int


def live_users(name: str) -> list[SegmentUser] | None:
    """The live sidecar first, then the live workers; None if there is no segment `name`.
    Raises SegmentError if it cannot be read (another user's)."""
    prefix = _read_prefix(name)
    if prefix is None:
        return None
    if prefix.magic != layout.MAGIC:  # not a CacheRoute table, or not initialised yet
        return []
    users = []
    if prefix.sidecar_identity and process_identity.is_alive(prefix.sidecar_identity):
        users.append(SegmentUser("sidecar", ProcessIdentity.pid(prefix.sidecar_identity)))
    if prefix.layout_version == layout.LAYOUT_VERSION:
        users += _live_workers(name, prefix.sidecar_identity)
    return users


def _read_prefix(name: str) -> HeaderPrefix | None:
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.ExistentialError:
        return None
    except posix_ipc.PermissionsError as exc:
        raise SegmentError(f"cannot read shared memory {name}: {exc} (it belongs to another user)") from None
    try:
        if shm.size < layout.HEADER_SIZE:
            return HeaderPrefix(0, 0, 0)  # being created
        with mmap.mmap(shm.fd, layout.HEADER_SIZE, prot=mmap.PROT_READ) as mapping:
            return HeaderPrefix(*(_WORD.unpack_from(mapping, offset)[0] for offset in
                                  (layout.H_MAGIC, layout.H_LAYOUT_VERSION, layout.H_SIDECAR_IDENTITY)))
    finally:
        shm.close_fd()


def _live_workers(name: str, sidecar_identity: int) -> list[SegmentUser]:
    try:
        seg = Segment.attach(name)
    except SegmentError:  # damaged, or gone meanwhile: no rows to read
        return []
    try:
        # A row the sidecar is reaping carries the sidecar's identity for a moment: not a worker.
        return [SegmentUser("worker", row.pid) for row in read_rows(seg)
                if row.identity != sidecar_identity and process_identity.is_alive(row.identity)]
    finally:
        seg.close()
