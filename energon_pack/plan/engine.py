"""Running the measure stage on Ray Data: the partitions become a Ray dataset, each is measured
by :func:`~energon_pack.plan.measure.measure_partition` in a pool of Ray actors, one per CPU,
each holding the encoder (Ray schedules, retries and shows the progress), and the columns come
back to the driver.

Without an address a local Ray is started with every core and stopped when done; with
``address`` (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``) the running cluster is joined
and left running. A Ray already started in this process (``ray.init`` by the caller) is used
as it is.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import pickle
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.plan.measure import COLUMNS, NUMBERS, measure_partition
from energon_pack.plan.spec import PlanSpec

_FAILED = "failed"
"""The ``skip`` of the row that carries a task's error."""
RAY_FIX = "install the extra: pip install 'energon_pack[ray]'"


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Ray, started here (local, every core) or joined at ``address``, for the block; a Ray
    started here is shut down after it."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"planning runs on Ray Data, which is not installed; {RAY_FIX}") from None
    if address is not None:
        _check_reachable(address)
    if ray.is_initialized():
        yield
        return
    settings: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if address is None:
        settings["num_cpus"] = os.cpu_count() or 1
    else:
        settings["address"] = address
    try:
        ray.init(**settings)
    except ConnectionError as error:
        raise ValueError(
            f"--ray-address {address!r}: no Ray cluster answers there ({error}); start one "
            "(ray start --head) or leave the address out to run locally"
        ) from None
    try:
        yield
    finally:
        ray.shutdown()


CONNECT_SECONDS = 10.0
"""How long a cluster address may take to accept a connection before it is called unreachable
(Ray itself retries a wrong address for minutes)."""


def _check_reachable(address: str) -> None:
    """A ValueError naming ``--ray-address`` when nothing accepts a connection at its host and
    port (``auto`` is left to Ray, which looks for a cluster started on this machine)."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as error:
        raise ValueError(
            f"--ray-address {address!r}: nothing answers at {host}:{port} ({error}); start the "
            "cluster (ray start --head) and pass its address, or leave the address out to run "
            "locally"
        ) from None


def measure_on_ray(
    partitions: list[str],
    encoder: SampleEncoder,
    spec: PlanSpec,
    media_root: Path | None,
    address: str | None = None,
    progress: int | None = None,
    on_rows: Callable[[int], object] = lambda rows: None,
) -> dict[str, npt.NDArray[Any]]:
    """The :data:`~energon_pack.plan.measure.COLUMNS` of every row of ``partitions``, in row
    order, measured by Ray tasks. With ``progress`` (the source's row count) a progress bar on
    stderr counts the rows measured (in place of Ray Data's own); ``on_rows`` is called with the
    row count of each partition as it comes back."""
    try:
        pickle.dumps(encoder)
    except Exception as error:  # whatever the encoder holds that does not pickle
        raise ValueError(
            f"the encoder cannot travel to Ray's workers: pickling it fails ({error}); pass an "
            "encoder that make_encoder() builds, with a tokenizer that pickles"
        ) from None
    with ray_session(address):
        import ray
        import ray.data

        cpus = ray.cluster_resources().get("CPU", 1)  # type: ignore[no-untyped-call]
        workers = max(1, min(len(partitions), int(cpus)))
        with _progress_shown_here(progress is not None):
            dataset = ray.data.from_items(
                [{"part": part} for part in partitions], override_num_blocks=len(partitions)
            )
            measured = dataset.map_batches(
                PartitionMeasurer,
                fn_constructor_kwargs={"encoder": encoder, "spec": spec, "media_root": media_root},
                compute=ray.data.ActorPoolStrategy(size=workers),
                batch_size=1,
                batch_format="numpy",
            )
            batches = []
            shown = progress is not None
            with tqdm(total=progress, unit="row", desc="measuring", disable=not shown) as bar:
                for batch in measured.iter_batches(batch_size=None, batch_format="numpy"):
                    batches.append(batch)
                    bar.update(len(batch["index"]))
                    on_rows(len(batch["index"]))
    columns = _concatenated(batches)
    failed = np.flatnonzero(columns["skip"] == _FAILED)
    if failed.size:
        raise pickle.loads(base64.b64decode(columns["reason"][failed[0]]))
    order = np.argsort(columns["index"], kind="stable")
    return {name: values[order] for name, values in columns.items()}


@contextlib.contextmanager
def _progress_shown_here(shown: bool) -> Iterator[None]:
    """With ``shown``, Ray Data's own progress bars and progress log lines are off for the
    block (this module's bar counts the rows instead)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    logger = logging.getLogger("ray.data")
    bars, level = context.enable_progress_bars, logger.level
    if shown:
        context.enable_progress_bars = False
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        context.enable_progress_bars = bars
        logger.setLevel(level)


class PartitionMeasurer:
    """The measure stage as a Ray Data actor: the encoder is unpickled once per actor (one
    per CPU), not once per partition (a real tokenizer takes most of a second)."""

    def __init__(self, encoder: SampleEncoder, spec: PlanSpec, media_root: Path | None) -> None:
        self.encoder, self.spec, self.media_root = encoder, spec, media_root

    def __call__(self, batch: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        try:
            parts = [
                measure_partition(str(part), self.encoder, self.spec, self.media_root)
                for part in batch["part"]
            ]
        except (ValueError, OSError) as error:  # Ray would keep only its text
            return _failure(error)
        return _concatenated(parts)


def _failure(error: ValueError | OSError) -> dict[str, npt.NDArray[Any]]:
    """One row that carries ``error`` whole (pickled) to the driver, which raises it."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS[:NUMBERS], -1)
    row.update(key="", skip=_FAILED, reason=base64.b64encode(pickle.dumps(error)).decode("ascii"))
    return {
        name: np.asarray([row[name]], dtype=np.int64 if position < NUMBERS else object)
        for position, name in enumerate(COLUMNS)
    }


def _concatenated(batches: list[dict[str, npt.NDArray[Any]]]) -> dict[str, npt.NDArray[Any]]:
    if not batches:
        return {
            name: np.zeros(0, dtype=np.int64 if position < NUMBERS else object)
            for position, name in enumerate(COLUMNS)
        }
    return {name: np.concatenate([batch[name] for batch in batches]) for name in COLUMNS}
