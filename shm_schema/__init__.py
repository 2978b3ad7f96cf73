"""The shared load table: one POSIX shared-memory segment read by every worker without IPC.

`layout` is the only module that knows byte offsets; the others speak in slots and rows.
"""

from .counters import (InflightReader, Reaped, RowState, WorkerRow, WorkerTableFull, free_row,
                       inflight_count, read_rows, reap_row, reconcile_slot, row_contributions,
                       subtract_row)
from .directory import (DirectoryFull, DirectoryReader, DirectorySnapshot, DirectoryWriter,
                        InstanceSlot, encode_identity, read_all)
from .layout import LAYOUT_VERSION, word_count, word_generation
from .segment import Segment, SegmentError, SegmentLayoutError, SegmentNotFound

__all__ = [
    "DirectoryFull", "DirectoryReader", "DirectorySnapshot", "DirectoryWriter", "InflightReader",
    "InstanceSlot", "LAYOUT_VERSION", "Reaped", "RowState", "Segment", "SegmentError", "SegmentLayoutError",
    "SegmentNotFound", "WorkerRow", "WorkerTableFull", "encode_identity", "free_row",
    "inflight_count", "read_all", "read_rows", "reap_row", "reconcile_slot", "row_contributions",
    "subtract_row", "word_count", "word_generation",
]
