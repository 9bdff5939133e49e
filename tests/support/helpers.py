"""Reusable test helpers (in ``tests/support/``, imported by bare name: ``from helpers import
...``)."""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import av
import numpy as np
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
from PIL import Image

from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.energon import PackedBatch, PackingTaskEncoder
from energon_pack.media import MediaConfig
from energon_pack.packing.packed import pack_samples
from energon_pack.tune import stop_workers

ROOT = Path(__file__).resolve().parents[2]
"""The checkout."""
SUPPORT = Path(__file__).resolve().parent
"""``tests/support/``: these helpers and the scripts tests run by path (``distributed_*.py``)."""

# Small vision budgets keep decoding cheap; the token layout rules are the same.
SMALL_MEDIA = MediaConfig(
    max_pixels=28 * 28 * 64,
    video_min_pixels=28 * 28 * 4,
    video_max_pixels=28 * 28 * 16,
    video_total_pixels=28 * 28 * 256,
    video_fps=1.0,
)

Samples = dict[str, dict[str, bytes]]
"""``{sample key: {member name: bytes}}`` of a WebDataset dataset."""


def read_samples(path: Path) -> Samples:
    """Every sample of the ``*.tar`` shards in ``path``, members by name (``json``, ``0.jpg``)."""
    samples: Samples = {}
    for shard in sorted(path.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                key, _, member = info.name.partition(".")
                handle = tar.extractfile(info)
                assert handle is not None
                samples.setdefault(key, {})[member] = handle.read()
    return samples


def load_script(path: Path) -> ModuleType:
    """The Python file at ``path`` (e.g. a fixture generator) imported as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


T = TypeVar("T")
Step = Callable[[T], Any]


def json_roundtrip(state: Any) -> Any:
    """The state as it comes back from a JSON file (and proof that it is JSON-able)."""
    return json.loads(json.dumps(state))


def assert_resume_equivalent(
    make: Callable[[], T],
    steps: Sequence[Step[T]],
    at: int,
    *,
    save: Callable[[T], Any],
    load: Callable[[T, Any], None],
    roundtrip: Callable[[Any], Any] = json_roundtrip,
) -> None:
    """Check that a stateful piece resumes exactly.

    Runs every step on a fresh object (the reference); runs the first ``at`` steps on another,
    saves its state, passes it through ``roundtrip``, loads it into a third fresh object and
    runs the remaining steps there. What each remaining step returns must equal the reference.
    Loaders made meanwhile by :func:`savable_loader` have their workers stopped on return.
    """
    with loaders_stopped():
        reference = make()
        expected = [step(reference) for step in steps]
        first = make()
        for step in steps[:at]:
            step(first)
        state = roundtrip(save(first))
        resumed = make()
        load(resumed, state)
        got = [step(resumed) for step in steps[at:]]
    assert got == expected[at:], f"resumed at step {at} of {len(steps)} diverged"


def assert_restore_at_every_step_is_invisible(
    make: Callable[[], T],
    steps: Sequence[Step[T]],
    *,
    save: Callable[[T], Any],
    load: Callable[[T, Any], None],
    roundtrip: Callable[[Any], Any] = json_roundtrip,
) -> None:
    """Check that saving and restoring at every step index changes nothing.

    Runs the steps on a reference object, and on a second object that before every step is
    saved, passed through ``roundtrip`` and replaced by a fresh object loaded from that state.
    Loading must leave the state as it was, the fresh object must save the same state again,
    and what each step returns must equal the reference. Loaders made meanwhile by
    :func:`savable_loader` have their workers stopped on return.
    """
    with loaders_stopped():
        reference, restored = make(), make()
        for at, step in enumerate(steps):
            state = roundtrip(save(restored))
            kept = copy.deepcopy(state)
            restored = make()
            load(restored, state)
            assert state == kept, f"loading the state saved before step {at} changed it"
            assert roundtrip(save(restored)) == state, (
                f"the state loaded at step {at} saves differently"
            )
            assert step(restored) == step(reference), (
                f"restored before step {at}, the step diverged"
            )


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def video_bytes(width: int = 96, height: int = 64, frames: int = 8, fps: int = 4) -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        for index in range(frames):
            array = np.full((height, width, 3), index * 20 % 256, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def make_encoder(**overrides: Any) -> PackingTaskEncoder:
    settings: dict[str, Any] = {"seq_length": 8192, "pad_to_multiple_of": 8, "media": SMALL_MEDIA}
    return PackingTaskEncoder(**{**settings, **overrides})


def train_dataset(
    path: Path,
    buffer_size: int | None,
    *,
    workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
    repeat: bool = False,
    **overrides: Any,
) -> Any:
    return get_train_dataset(
        path,
        worker_config=WorkerConfig(rank=rank, world_size=world_size, num_workers=workers),
        batch_size=1,
        packing_buffer_size=buffer_size,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=make_encoder(**overrides),
        repeat=repeat,
    )


_loaders: list[Any] = []
"""Every loader :func:`savable_loader` made whose workers are not stopped yet, oldest first."""


def savable_loader(dataset: Any, **kwargs: Any) -> Any:
    """``get_savable_loader(dataset, **kwargs)``, kept until its workers are stopped: on leaving
    the :func:`loaders_stopped` block it was made in, else after the test (``conftest.py``)."""
    loader = get_savable_loader(dataset, **kwargs)
    _loaders.append(loader)
    return loader


@contextmanager
def loaders_stopped() -> Iterator[None]:
    """Stop the workers of every :func:`savable_loader` made inside the block, on leaving it."""
    start = len(_loaders)
    try:
        yield
    finally:
        stop_loaders(since=start)


def stop_loaders(since: int = 0) -> None:
    """Stop the workers of every :func:`savable_loader` not stopped yet (from the ``since``-th)."""
    made = _loaders[since:]
    del _loaders[since:]
    for loader in made:
        stop_workers(loader)


def batches(dataset: Any) -> Iterator[PackedBatch]:
    """The batches of a fresh :func:`savable_loader` over ``dataset``; its workers are stopped
    once the batches run out or the caller drops the iterator."""
    loader = savable_loader(dataset)
    try:
        yield from loader
    finally:
        stop_workers(loader)


def native_pack(samples: Samples, keys: Sequence[str], media: MediaConfig = SMALL_MEDIA) -> Any:
    """The ``PackedSample`` that :func:`make_encoder`'s packing makes of native ``samples[k]``
    for ``keys``, in order: the reference for other sample layouts."""
    encoder = ConversationEncoder(media=media)
    return pack_samples(
        [encoder.encode_sample(key, samples[key]) for key in keys],
        seq_length=8192,
        pad_to_multiple_of=8,
        pad_token_id=encoder.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        media=media,
    )


class LoaderRun:
    """A savable loader over :func:`train_dataset` (repeating) and its iterator, for the resume
    helper: ``step`` returns one pack's keys, token ids and pixel sum."""

    def __init__(self, path: Path, buffer_size: int = 16, *, workers: int = 0, **overrides: Any):
        self._start(train_dataset(path, buffer_size, workers=workers, repeat=True, **overrides))

    def _start(self, dataset: Any) -> None:
        """Load from ``dataset``: a fresh savable loader, not iterated yet."""
        self.dataset = dataset
        self.loader = savable_loader(
            self.dataset, checkpoint_every_sec=0, checkpoint_every_min_n_samples=1
        )
        self._iterator: Iterator[PackedBatch] | None = None

    def step(self) -> tuple[Any, ...]:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        batch = next(self._iterator)
        return tuple(batch.__keys__), batch.input_ids.tolist(), self.media_sum(batch)

    def media_sum(self, batch: PackedBatch) -> float | None:
        """The sum of the pack's pixels (None without images)."""
        return None if batch.pixel_values is None else float(batch.pixel_values.sum())

    def save(self) -> Any:
        return self.loader.save_state_rank()

    def load(self, state: Any) -> None:
        self.loader.restore_state_rank(state)


class FamilyLoaderRun(LoaderRun):
    """A :class:`LoaderRun` over a given (repeating) dataset of a processor family: ``step``
    gives the sum of the pack's family inputs in place of its pixels."""

    def __init__(self, dataset: Any) -> None:
        self._start(dataset)

    def media_sum(self, batch: PackedBatch) -> float:
        """The sum of every tensor of the pack's family inputs."""
        inputs = batch.family_inputs
        assert inputs is not None
        return float(sum(t.double().sum() for t in inputs.tensors().values()))


CUT_POINTS = [1, 4, 9]
"""The cut points (packs taken before the save) of the three-cut resume tests."""


def assert_loader_resumes(make: Callable[[], LoaderRun], at: int, steps: int = 12) -> None:
    """:func:`assert_resume_equivalent` over ``steps`` packs of the runs ``make`` gives, cut
    after ``at`` (the loader state passed on as it is)."""
    assert_resume_equivalent(
        make,
        [LoaderRun.step] * steps,
        at,
        save=LoaderRun.save,
        load=LoaderRun.load,
        roundtrip=lambda state: state,
    )


def fixture_maker() -> ModuleType:
    """``fixtures/make_fixtures.py`` as a module (tar writing, Energon preparation)."""
    return load_script(ROOT / "fixtures" / "make_fixtures.py")


def text_dataset(root: Path, lengths: Sequence[int]) -> Path:
    """A prepared Energon dataset at ``root`` of text-only conversations whose encodings (built-in
    tokenizer and template) have the given token ``lengths``, in order, keys ``t00000``..."""
    encoder = ConversationEncoder()

    def conversation(chars: int) -> bytes:
        turns = [{"from": "human", "value": "x" * chars}, {"from": "gpt", "value": "ok"}]
        return json.dumps({"conversations": turns}).encode()

    overhead = encoder.encode_sample("probe", {"json": conversation(1)}).length - 1
    members = [
        (f"t{index:05d}.json", conversation(length - overhead))
        for index, length in enumerate(lengths)
    ]
    maker = fixture_maker()
    root.mkdir(parents=True, exist_ok=True)
    maker.write_tar(root / "shard-000000.tar", members)
    maker.prepare_energon(root, [root / "shard-000000.tar"])
    return root


def torchrun(script: Path, *args: object, env: dict[str, str] | None = None) -> None:
    """Run ``script`` on 2 local processes with ``torch.distributed.run`` on a free port; the
    processes import this checkout's ``energon_pack``. Fails with the processes' stderr."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    command += [f"--master_port={port}", str(script), *map(str, args)]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(
        command, timeout=300, capture_output=True, text=True, env=environment, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]


def packing_states(value: Any) -> Iterator[Mapping[str, Any]]:
    """The saved CarryOverPackingDataset states in a loader state (one per worker)."""
    if isinstance(value, Mapping):
        if value.get("__class__") == "CarryOverPackingDataset":
            yield value
        else:
            for item in value.values():
                yield from packing_states(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from packing_states(item)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from packing_states(getattr(value, name))
