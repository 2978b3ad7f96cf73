"""The shared load table: one POSIX shared-memory segment read by every worker without IPC.

`layout` is the only module that knows byte offsets; the others speak in slots and rows.
"""

from . import layout
from .counters import (Admission, CountersReader, WorkerRow, WorkerTableFull, counter_value,
                       inflight_count)
from .directory import (DirectoryFull, DirectoryReader, DirectorySnapshot, DirectoryWriter,
                        InstanceSlot, encode_identity, read_all)
from .layout import LAYOUT_VERSION, word_count, word_generation
from .repair import (Reaped, RowState, free_row, read_rows, reap_row, reconcile, reconcile_slot,
                     row_contributions, subtract_row, take_row)
from .segment import Segment, SegmentError, SegmentLayoutError, SegmentNotFound

__all__ = [
    "Admission", "CountersReader", "counter_value", "layout", "reconcile", "take_row",
    "DirectoryFull", "DirectoryReader", "DirectorySnapshot", "DirectoryWriter",
    "InstanceSlot", "LAYOUT_VERSION", "Reaped", "RowState", "Segment", "SegmentError", "SegmentLayoutError",
    "SegmentNotFound", "WorkerRow", "WorkerTableFull", "encode_identity", "free_row",
    "inflight_count", "read_all", "read_rows", "reap_row", "reconcile_slot", "row_contributions",
    "subtract_row", "word_count", "word_generation",
]
