"""``energon-pack tune``: measure packing and worker memory per buffer size on real data.

For each buffer size (and decode mode) the dataset streams through the real Energon loader with
real workers and a :class:`~energon_pack.memory.RSSMonitor` in each worker. By default a run
repeats the dataset until it has ``TuneSettings.min_packs`` packs, so its bin fill is the steady
state's, with no end-of-epoch flush in it (``one_epoch``: one pass, flush included). A run
records its packs, bin fill, token efficiency, first-pack latency, throughput (over wall time,
where it has enough packs to time), worker RSS and the samples it skipped (by kind);
:func:`recommend` picks the best-filling buffer whose projected memory fits a budget.
Token counts come from the tokenizer the user trains with (``TuneSettings.tokenizer``).

Its parts: :mod:`~energon_pack.tune.runs` (one run), :mod:`~energon_pack.tune.tokenizers` (the
tokenizer it measures with) and :mod:`~energon_pack.tune.table` (what it prints and
recommends).
"""

from energon_pack.tune.runs import (
    TIMED_PACKS,
    CtrlC,
    TuneError,
    TuneResult,
    TuneSettings,
    default_dataset,
    error_line,
    run_once,
    sigint_held,
    start_workers_whole,
    stop_workers,
)
from energon_pack.tune.table import (
    BUFFER_BOUND_FILL,
    BUFFER_BOUND_SHARE,
    FULL_ENOUGH,
    STILL_RISING,
    TUNE_HEADERS,
    buffer_bound_note,
    confidence_cell,
    measurement_note,
    projected_rss_mb,
    recommend,
    run_name,
    skipped_cell,
    still_rising_notes,
    too_few_packs_note,
    tune_row,
    untimed_note,
    vision_share_note,
    worker_total_mb,
)
from energon_pack.tune.tokenizers import (
    MAX_TEMPLATE_BYTES,
    describe_tokenizer,
    load_tokenizer,
    read_chat_template,
    tokenizer_label,
    tokenizer_of,
)

__all__ = [
    "BUFFER_BOUND_FILL",
    "BUFFER_BOUND_SHARE",
    "FULL_ENOUGH",
    "MAX_TEMPLATE_BYTES",
    "STILL_RISING",
    "TIMED_PACKS",
    "TUNE_HEADERS",
    "CtrlC",
    "TuneError",
    "TuneResult",
    "TuneSettings",
    "buffer_bound_note",
    "confidence_cell",
    "default_dataset",
    "describe_tokenizer",
    "error_line",
    "load_tokenizer",
    "measurement_note",
    "projected_rss_mb",
    "read_chat_template",
    "recommend",
    "run_name",
    "run_once",
    "sigint_held",
    "skipped_cell",
    "start_workers_whole",
    "still_rising_notes",
    "stop_workers",
    "tokenizer_label",
    "tokenizer_of",
    "too_few_packs_note",
    "tune_row",
    "untimed_note",
    "vision_share_note",
    "worker_total_mb",
]
