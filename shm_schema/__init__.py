"""The shared load table: one POSIX shared-memory segment read by every worker without IPC.

`records` declares every multi-word record and `bitfields` every bit-packed word, once;
`layout` places them in the segment (the byte map). The other modules speak in slots, rows
and named fields: `segment` (create, attach, validate), `header`, `directory`, `counters`
(the worker's path), `repair` (the sidecar's), `snapshot`, `events`, `process_identity`,
`users` (who still uses a segment, for a tool that would remove it).
Outside the segment, `metric_file` lays out the per-worker file of metric values that
/metrics sums.
"""

from . import layout
from .bitfields import CounterWord
from .counters import (Admission, CountersReader, WorkerRow, WorkerTableFull, claimed_rows,
                       counter_value, inflight_count)
from .directory import (DirectoryFull, DirectoryReader, DirectorySnapshot, DirectoryWriter,
                        InstanceSlot, encode_identity, read_all)
from .layout import LAYOUT_VERSION
from .repair import (Reaped, RowState, free_row, read_rows, reap_row, reconcile, reconcile_slot,
                     row_contributions, subtract_row, take_row)
from .segment import Segment, SegmentError, SegmentLayoutError, SegmentNotFound

__all__ = [
    "Admission", "CounterWord", "CountersReader", "claimed_rows", "counter_value", "layout", "reconcile",
    "take_row", "DirectoryFull", "DirectoryReader", "DirectorySnapshot", "DirectoryWriter",
    "InstanceSlot", "LAYOUT_VERSION", "Reaped", "RowState", "Segment", "SegmentError",
    "SegmentLayoutError", "SegmentNotFound", "WorkerRow", "WorkerTableFull", "encode_identity",
    "free_row", "inflight_count", "read_all", "read_rows", "reap_row", "reconcile_slot",
    "row_contributions", "subtract_row",
]
