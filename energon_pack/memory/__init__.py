"""Worker memory: the psutil RSS monitor with its buffer-growth warnings (``monitor``), and its
JSON-lines report read back as summaries and plots (``report``)."""

from energon_pack.memory.monitor import (
    MB,
    BufferMemoryWarning,
    BufferSnapshot,
    MonitorConfig,
    Reading,
    ReportWriteWarning,
    RSSMonitor,
    advice,
    suggest_buffer_size,
)
from energon_pack.memory.report import (
    SUMMARY_HEADERS,
    WorkerSummary,
    load_report,
    plot_report,
    summarize,
    summary_rows,
)

__all__ = [
    "MB",
    "SUMMARY_HEADERS",
    "BufferMemoryWarning",
    "BufferSnapshot",
    "MonitorConfig",
    "RSSMonitor",
    "Reading",
    "ReportWriteWarning",
    "WorkerSummary",
    "advice",
    "load_report",
    "plot_report",
    "suggest_buffer_size",
    "summarize",
    "summary_rows",
]
