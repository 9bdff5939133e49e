"""Running a stage over a source's partitions: on Ray Data (the partitions become a Ray dataset,
each is worked in a pool of Ray actors, one per CPU, each holding the stage's work with its
encoder; Ray schedules and retries), or in this process. Each partition's columns come back to
the driver as they are done.

Without an address a local Ray is started with every core and stopped when done; with
``address`` (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``) the running cluster is joined
and left running. A Ray already started in this process (``ray.init`` by the caller) is used
as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

RAY_FIX = "install the extra: pip install 'energon_pack[ray]'"

Engine = Literal["local", "ray"]
"""Where a stage works the partitions: in this process, or on Ray Data's workers."""
ENGINES: tuple[Engine, ...] = ("local", "ray")


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Ray, started here (local, every core) or joined at ``address``, for the block; a Ray
    started here is shut down after it."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            f"Ray Data is not installed (energon-pack plan and offline --ray run on it); {RAY_FIX}"
        ) from None
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


PartitionWork = Callable[[str], dict[str, npt.NDArray[Any]]]
"""A stage's work on one partition of a source (a ``partitions()`` entry): its columns, one
value per row. It must pickle (it travels to Ray's workers once per actor) and may raise only
ValueError or OSError for bad input (raised again on the driver, whole)."""


def run_partitions(
    partitions: list[str],
    work: PartitionWork,
    engine: Engine,
    address: str | None = None,
    progress: int | None = None,
    stage: str = "reading",
) -> Iterator[tuple[int, dict[str, npt.NDArray[Any]]]]:
    """:func:`partitions_on_ray` (``engine="ray"``, on the cluster at ``address`` or a local
    Ray) or :func:`partitions_here` (``"local"``)."""
    if engine == "ray":
        return partitions_on_ray(partitions, work, address, progress, stage)
    return partitions_here(partitions, work, progress, stage)


def partitions_here(
    partitions: list[str],
    work: PartitionWork,
    progress: int | None = None,
    stage: str = "reading",
) -> Iterator[tuple[int, dict[str, npt.NDArray[Any]]]]:
    """``(partition number, columns)`` of each partition, worked in this process in order;
    with ``progress`` (the source's row count), a progress bar named ``stage`` on stderr
    counts the rows."""
    with tqdm(total=progress, unit="row", desc=stage, disable=progress is None) as bar:
        for number, part in enumerate(partitions):
            columns = work(part)
            bar.update(_rows(columns))
            yield number, columns


def partitions_on_ray(
    partitions: list[str],
    work: PartitionWork,
    address: str | None = None,
    progress: int | None = None,
    stage: str = "reading",
) -> Iterator[tuple[int, dict[str, npt.NDArray[Any]]]]:
    """``(partition number, columns)`` of each partition as Ray Data's actors finish them (in
    any order): one actor per CPU of the cluster, each holding ``work``. With ``progress``
    (the source's row count) a progress bar named ``stage`` on stderr counts the rows (in
    place of Ray Data's own). The first partition whose work raised raises its error here."""
    try:
        pickle.dumps(work)
    except Exception as error:  # whatever the work holds that does not pickle
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
                [{"number": k, "part": part} for k, part in enumerate(partitions)],
                override_num_blocks=len(partitions),
            )
            worked = dataset.map_batches(
                PartitionActor,
                fn_constructor_kwargs={"work": work},
                compute=ray.data.ActorPoolStrategy(size=workers),
                batch_size=1,
                batch_format="numpy",
            )
            shown = progress is not None
            with tqdm(total=progress, unit="row", desc=stage, disable=not shown) as bar:
                for batch in worked.iter_batches(batch_size=None, batch_format="numpy"):
                    for number, payload in zip(batch["number"], batch["payload"], strict=True):
                        outcome = pickle.loads(payload)
                        if isinstance(outcome, Exception):
                            raise outcome
                        bar.update(_rows(outcome))
                        yield int(number), outcome


def _rows(columns: dict[str, npt.NDArray[Any]]) -> int:
    return len(next(iter(columns.values()), ()))


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


class PartitionActor:
    """A stage as a Ray Data actor: its work (the encoder it holds) is unpickled once per
    actor, not once per partition (a real tokenizer takes most of a second). Each partition
    comes back as one row: its number and its columns, or the error its work raised, pickled
    (Ray would keep only an error's text)."""

    def __init__(self, work: PartitionWork) -> None:
        self.work = work

    def __call__(self, batch: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        payloads = []
        for part in batch["part"]:
            try:
                outcome: object = self.work(str(part))
            except (ValueError, OSError) as error:
                outcome = error
            payloads.append(pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL))
        return {"number": batch["number"], "payload": np.asarray(payloads, dtype=object)}
