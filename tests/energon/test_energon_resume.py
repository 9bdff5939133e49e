"""Exact, safe resume of the Energon path: pending packs, carried-over samples, restoring one
state twice, and settings fingerprints (real loaders over datasets built in a temp dir)."""

from __future__ import annotations

import copy
import itertools
import json
import logging
import pickle
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    SMALL_MEDIA,
    LoaderRun,
    assert_resume_equivalent,
    fixture_maker,
    image_bytes,
    packing_states,
    read_samples,
    savable_loader,
    text_dataset,
    train_dataset,
)

from energon_pack import BufferConfig
from energon_pack.encoding.chatml import ByteTokenizer, ConversationEncoder
from energon_pack.energon import PackingTaskEncoder, restore_state_rank, state_check
from energon_pack.media import MediaConfig
from energon_pack.packing.bins import aligned_length


def pickle_roundtrip(state: Any) -> Any:
    return pickle.loads(pickle.dumps(state))


@pytest.fixture(scope="module")
def demo_lengths(vlm_demo_path: Path) -> list[int]:
    """Token lengths of the demo samples (SMALL_MEDIA) that fit 1024 tokens, in key order."""
    encoder = ConversationEncoder(media=SMALL_MEDIA)
    samples = read_samples(vlm_demo_path)
    lengths = [encoder.encode_sample(key, samples[key]).length for key in sorted(samples)]
    return [length for length in lengths if aligned_length(length, 8) <= 1024]


@pytest.fixture(scope="module")
def text_path(tmp_path_factory: pytest.TempPathFactory, demo_lengths: list[int]) -> Path:
    """1500 text-only samples with the demo's token lengths, cycled."""
    lengths = list(itertools.islice(itertools.cycle(demo_lengths), 1500))
    return text_dataset(tmp_path_factory.mktemp("text"), lengths)


def first_checkpoint(run: LoaderRun, wanted: str, limit: int = 60) -> int:
    """Steps ``run`` until its saved state holds a pending pack (``"pending"``) or a sample
    carried over to a later pack (``"carried"``); returns the number of steps."""
    for at in range(limit):
        for state in packing_states(run.save()):
            pending = {seq for pack in state["_pending"] for seq in pack}
            if wanted == "pending" and pending:
                return at
            if wanted == "carried" and set(state["_buffer_seqs"]) - pending:
                return at
        run.step()
    raise AssertionError(f"no checkpoint with a {wanted} pack within {limit} packs")


# Small max_wait and buffer: several packs often leave after one sample (pending packs).
PENDING = {"buffer_size": 6, "seq_length": 1024, "max_wait": 2, "min_fill": 0.9}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("wanted", ["pending", "carried"])
def test_resume_at_pending_and_carried_over_checkpoints(
    text_path: Path, workers: int, wanted: str
) -> None:
    def make() -> LoaderRun:
        return LoaderRun(text_path, workers=workers, **PENDING)

    at = first_checkpoint(make(), wanted)
    assert_resume_equivalent(
        make,
        [LoaderRun.step] * (at + 12),
        at,
        save=LoaderRun.save,
        load=LoaderRun.load,
        roundtrip=pickle_roundtrip,
    )


def test_resume_at_pack_500_with_buffer_64(text_path: Path) -> None:
    """Buffer 64, seq_length 1024: this checkpoint once diverged a few packs later."""
    assert_resume_equivalent(
        lambda: LoaderRun(text_path, 64, seq_length=1024),
        [LoaderRun.step] * 530,
        500,
        save=LoaderRun.save,
        load=LoaderRun.load,
        roundtrip=pickle_roundtrip,
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_one_state_restores_twice_to_the_same_stream(text_path: Path, workers: int) -> None:
    run = LoaderRun(text_path, workers=workers, **PENDING)
    expected = [run.step() for _ in range(20)]
    first = LoaderRun(text_path, workers=workers, **PENDING)
    for _ in range(8):
        first.step()
    state = first.save()
    kept = pickle.dumps(state)
    for _ in range(2):
        resumed = LoaderRun(text_path, workers=workers, **PENDING)
        resumed.load(state)
        assert [resumed.step() for _ in range(12)] == expected[8:]
        assert pickle.dumps(state) == kept, "restoring changed the saved state"


class EpochRun(LoaderRun):
    """:class:`LoaderRun` over one epoch (``repeat=False``): ``next_pack`` is ``step``, or None
    once the epoch is over; ``delivered`` lists the keys of every pack it returned."""

    def __init__(
        self, path: Path, buffer_size: int = 16, *, workers: int = 0, **overrides: Any
    ) -> None:
        self.dataset = train_dataset(path, buffer_size, workers=workers, repeat=False, **overrides)
        self.loader = savable_loader(
            self.dataset, checkpoint_every_sec=0, checkpoint_every_min_n_samples=1
        )
        self._iterator = None
        self.delivered: list[str] = []

    def next_pack(self) -> tuple[Any, ...] | None:
        try:
            pack = self.step()
        except StopIteration:
            return None
        self.delivered += pack[0]
        return pack


# Default max_wait and min_fill: with buffer 6 each worker's flush (after its source ran dry)
# emits its last 2-3 packs.
EPOCH = {"buffer_size": 6, "seq_length": 1024}
EPOCH_SAMPLES = 60


@pytest.fixture(scope="module")
def epoch_path(tmp_path_factory: pytest.TempPathFactory, demo_lengths: list[int]) -> Path:
    """60 text-only samples with the demo's token lengths (one epoch: about 30 packs)."""
    lengths = list(itertools.islice(itertools.cycle(demo_lengths), EPOCH_SAMPLES))
    return text_dataset(tmp_path_factory.mktemp("epoch"), lengths)


def epoch_keys() -> Counter[str]:
    return Counter(f"t{index:05d}" for index in range(EPOCH_SAMPLES))


@pytest.fixture(scope="module")
def epoch_packs(epoch_path: Path) -> dict[int, int]:
    """Packs in one epoch, by number of workers; each run delivers every sample exactly once."""
    packs = {}
    for workers in (0, 2):
        run = EpochRun(epoch_path, workers=workers, **EPOCH)
        count = 0
        while run.next_pack() is not None:
            count += 1
        assert Counter(run.delivered) == epoch_keys()
        packs[workers] = count
    assert packs == {0: 30, 2: 31}, "END_OF_EPOCH_CUTS assume these epochs"
    return packs


# Cut points by the packs left after them (0: after the last pack), at every pack of the epoch.
# num_workers=0: the source runs dry after pack 28 of 30, so the last 2 packs and the end are the
# flush window. Two workers (31 packs, round robin): worker 1's source runs dry with 7 packs left
# in the loader, worker 0's with 4; every cut from there on restores a dry source (Energon resets
# a dry source to its next epoch; the wrapper saves that its source is done).
END_OF_EPOCH_CUTS = [
    *(pytest.param(0, left, id=f"workers0-left{left}") for left in range(31)),
    *(pytest.param(2, left, id=f"workers2-left{left}") for left in range(32)),
]


@pytest.mark.parametrize(("workers", "left"), END_OF_EPOCH_CUTS)
def test_resume_at_the_end_of_an_epoch(
    epoch_path: Path, epoch_packs: dict[int, int], workers: int, left: int
) -> None:
    """repeat=False: a checkpoint among the last packs (``left`` packs before the end; 0: after
    the last pack) resumes to the same end: the packs left, then nothing more."""
    runs: list[EpochRun] = []

    def make() -> EpochRun:
        runs.append(EpochRun(epoch_path, workers=workers, **EPOCH))
        return runs[-1]

    total = epoch_packs[workers]
    assert_resume_equivalent(
        make,
        [EpochRun.next_pack] * (total + 2),
        total - left,
        save=LoaderRun.save,
        load=LoaderRun.load,
        roundtrip=pickle_roundtrip,
    )
    _, first, resumed = runs
    assert Counter(first.delivered + resumed.delivered) == epoch_keys(), "not every sample once"


BLEND_BROKEN = {"bad_sample": 2, "corrupt": 2}
"""What the blend's second dataset holds besides text: samples the encoder rejects (bad JSON)
and samples whose image only fails when its pack decodes it (a truncated JPEG)."""


@pytest.fixture(scope="module")
def blend_path(tmp_path_factory: pytest.TempPathFactory, demo_lengths: list[int]) -> Path:
    """A metadataset blending two datasets once each (``blend_epochized``): 30 text samples,
    and 20 text samples with the broken ones of :data:`BLEND_BROKEN`; keys collide."""
    root = tmp_path_factory.mktemp("blend")
    lengths = list(itertools.islice(itertools.cycle(demo_lengths), 30))
    text_dataset(root / "a", lengths)
    text_dataset(root / "b", lengths[:20])
    image = image_bytes(64, 48, "JPEG")
    turns = [{"from": "human", "value": "<image>what is it?"}, {"from": "gpt", "value": "ok"}]
    broken = [("bad0.json", b"{not json"), ("bad1.json", b"[1, 2")]
    for index in range(BLEND_BROKEN["corrupt"]):
        broken += [
            (f"cut{index}.json", json.dumps({"conversations": turns}).encode()),
            (f"cut{index}.0.jpg", image[: len(image) // 2]),
        ]
    maker = fixture_maker()
    maker.write_tar(root / "b" / "shard-000001.tar", broken)
    maker.prepare_energon(root / "b", sorted((root / "b").glob("shard-*.tar")))
    (root / "blend.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
        "    blend_epochized:\n      - repetitions: 1\n        path: ./a\n"
        "      - repetitions: 1\n        path: ./b\n"
    )
    return root / "blend.yaml"


class BlendRun(EpochRun):
    """:class:`EpochRun` whose step also gives the worker's skip counts so far."""

    def __init__(
        self, path: Path, buffer_size: int = 16, *, workers: int = 0, **overrides: Any
    ) -> None:
        super().__init__(path, buffer_size, workers=workers, **overrides)
        self.skipped: dict[int, dict[str, int]] = {}
        """The last skip counts each worker reported."""

    def next_counted(self) -> tuple[Any, ...] | None:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        try:
            batch = next(self._iterator)
        except StopIteration:
            return None
        self.delivered += batch.__keys__
        stats = batch.packing_stats
        self.skipped[stats.worker] = dict(stats.skipped)
        return tuple(batch.__keys__), stats.worker, sorted(stats.skipped.items())


def blend_keys() -> Counter[str]:
    return Counter([f"t{i:05d}" for i in range(30)] + [f"t{i:05d}" for i in range(20)])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_a_blend_with_skips_at_every_pack(blend_path: Path, workers: int) -> None:
    """A blend with broken samples, cut at every pack of its epoch (flush packs and the end
    included; with workers, the last packs and the middle): each sample exactly once, and each
    skip counted once (the counts after the cut, pack by pack, are the uninterrupted run's)."""
    reference = BlendRun(blend_path, workers=workers, **EPOCH)
    stream = list(iter(reference.next_counted, None))
    assert Counter(reference.delivered) == blend_keys()
    totals: Counter[str] = Counter()
    for counts in reference.skipped.values():
        totals.update(counts)
    assert totals == BLEND_BROKEN
    end = len(stream)
    # Two workers: the middle and the last packs (each worker's flush window), to bound the time.
    cuts = range(end + 1) if workers == 0 else [end // 2, *range(end - 7, end + 1)]
    for cut in cuts:
        runs: list[BlendRun] = []

        def make(runs: list[BlendRun] = runs) -> BlendRun:
            runs.append(BlendRun(blend_path, workers=workers, **EPOCH))
            return runs[-1]

        assert_resume_equivalent(
            make,
            [BlendRun.next_counted] * (end + 2),
            cut,
            save=LoaderRun.save,
            load=LoaderRun.load,
            roundtrip=pickle_roundtrip,
        )
        _, first, resumed = runs
        assert Counter(first.delivered + resumed.delivered) == blend_keys(), f"cut {cut}"


@pytest.fixture(scope="module")
def saved_state(text_path: Path) -> Any:
    run = LoaderRun(text_path, **PENDING)
    for _ in range(3):
        run.step()
    return run.save()


class OtherTokenizer(ByteTokenizer):
    pass


CHANGED = [
    ("seq_length", {"seq_length": 2048}),
    ("pad_to_multiple_of", {"pad_to_multiple_of": 16}),
    ("pad_to_max_length", {"pad_to_max_length": True}),
    ("packing_buffer_size", {"buffer_size": 7}),
    ("packing_buffer_bytes", {"packing_buffer_bytes": 10**6}),
    ("max_wait", {"max_wait": 3}),
    ("min_fill", {"min_fill": 0.8}),
    ("decode", {"decode": "eager"}),
    ("media.max_pixels", {"media": MediaConfig(max_pixels=28 * 28 * 32)}),
    ("tokenizer.class", {"tokenizer": OtherTokenizer()}),
    ("system_prompt", {"system_prompt": "Be brief."}),
    ("loss_on", {"loss_on": "all"}),
    ("position_ids", {"position_ids": "mrope"}),
]


@pytest.mark.parametrize(("name", "change"), CHANGED, ids=[name for name, _ in CHANGED])
def test_a_changed_setting_is_refused_by_name(
    text_path: Path, saved_state: Any, name: str, change: dict[str, Any]
) -> None:
    settings = {**PENDING, **change}
    loader = LoaderRun(text_path, **settings).loader
    kept = pickle.dumps(saved_state)
    with pytest.raises(ValueError, match=rf"\b{name}: saved .*, now .*start a fresh run") as error:
        restore_state_rank(loader, saved_state)
    assert str(error.value).startswith("cannot restore")
    assert pickle.dumps(saved_state) == kept


def test_a_changed_buffer_growth_is_refused_by_name(text_path: Path, saved_state: Any) -> None:
    settings = {k: v for k, v in PENDING.items() if k not in ("max_wait", "min_fill")}
    grown = BufferConfig(max_wait=2, min_fill=0.9, min_rows=1.0)
    loader = LoaderRun(text_path, **settings, buffer=grown).loader
    with pytest.raises(ValueError, match=r"\bpacker\.min_rows: saved 2\.0, now 1\.0"):
        restore_state_rank(loader, saved_state)


def test_overlong_may_change_between_save_and_restore(text_path: Path, saved_state: Any) -> None:
    """What becomes of a sample no row takes does not change the packs of those that fit."""
    for overlong in ("error", "skip"):
        loader = LoaderRun(text_path, **{**PENDING, "overlong": overlong}).loader
        restore_state_rank(loader, saved_state)


def test_a_plain_restore_also_refuses_changed_settings(text_path: Path, saved_state: Any) -> None:
    loader = LoaderRun(text_path, **{**PENDING, "seq_length": 2048}).loader
    with pytest.raises(ValueError, match=r"seq_length: saved 1024, now 2048"):
        loader.restore_state_rank(saved_state)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"world_size": 2}, r"at 1 rank x 0 workers = 1 global worker, this loader runs 2 ranks"),
        ({"workers": 2}, r"= 1 global worker, this loader runs 1 rank x 2 workers = 2 global"),
        ({"workers": 1}, r"saved with num_workers=0, this loader has num_workers=1\b"),
    ],
)
def test_another_topology_is_refused_by_name(
    text_path: Path, saved_state: Any, change: dict[str, Any], message: str
) -> None:
    """The state of a loader without worker processes restores only at its topology (it is
    one FlexState per rank, which Energon cannot redistribute)."""
    loader = LoaderRun(text_path, **{**PENDING, **change}).loader
    with pytest.raises(ValueError, match=rf"{message}.*start a fresh run"):
        restore_state_rank(loader, saved_state)


def test_another_global_worker_count_is_refused_by_name(text_path: Path) -> None:
    run = LoaderRun(text_path, workers=2, **PENDING)
    for _ in range(3):
        run.step()
    state = run.save()
    with pytest.raises(
        ValueError,
        match=r"at 1 rank x 2 workers = 2 global workers, this loader runs 1 rank x 0 workers "
        r"= 1 global worker\. .*use 1x2 or 2x1",
    ):
        restore_state_rank(LoaderRun(text_path, **PENDING).loader, state)
    with pytest.raises(ValueError, match=r"runs 1 rank x 3 workers = 3 global workers"):
        restore_state_rank(LoaderRun(text_path, workers=3, **PENDING).loader, state)
    # Workers that had no state yet: the count alone still tells.
    for worker_state in state.worker_states:
        worker_state.state = None
    with pytest.raises(ValueError, match=r"num_workers=2, this loader has num_workers=3"):
        restore_state_rank(LoaderRun(text_path, workers=3, **PENDING).loader, state)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"seq_length": 8190, "pad_to_multiple_of": 8, "pad_to_max_length": True},
            r"seq_length=8190 is not a multiple of pad_to_multiple_of=8",
        ),
        ({"seq_length": 4, "pad_to_multiple_of": 8}, "pad_to_multiple_of=8 is larger"),
        ({"seq_length": 0}, "seq_length must be a positive int"),
        ({"seq_length": 1024, "overlong": "truncate"}, "overlong must be 'error' or 'skip'"),
    ],
)
def test_row_settings_are_checked_at_construction(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackingTaskEncoder(**settings)


# ------------------------------------------------------------ saved states checked on restore
SMALL_SAMPLES = 60
SMALL_LENGTHS = [120, 300, 500, 80, 700, 260, 410, 950, 40, 1000, 30]
"""Token lengths, cycled: sample 53 has 1000 tokens; pending packs occur."""


def small_dataset(root: Path, samples: int = SMALL_SAMPLES) -> Path:
    lengths = itertools.islice(itertools.cycle(SMALL_LENGTHS), samples)
    return text_dataset(root, list(lengths))


@pytest.fixture(scope="module")
def small_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_dataset(tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="module")
def carried_state(small_path: Path) -> Any:
    """A state whose packer holds samples carried over (and whose buffer holds them)."""
    return first_state(small_path, "carried")


def first_state(path: Path, wanted: str) -> Any:
    """The saved state of a fresh run at its :func:`first_checkpoint` holding ``wanted``."""
    run = LoaderRun(path, **PENDING)
    first_checkpoint(run, wanted)
    return run.save()


def tampered(state: Any, change: Any) -> Any:
    out = copy.deepcopy(state)
    (packing,) = packing_states(out)
    change(packing)
    return out


def _with_index(packing: dict[str, Any], value: Any) -> tuple[Any, ...]:
    """The first buffered restore key with its WebDataset sample index set to ``value``."""
    return (*packing["_buffer"]["_restore_keys"][0][:-1], value)


def _webdataset_index(packing: dict[str, Any], value: Any) -> None:
    packing["_buffer"]["_restore_keys"][0] = _with_index(packing, value)


STATE_TAMPERING = [
    (
        "a buffered sample listed twice",
        lambda p: (
            p["_buffer"]["_restore_keys"].append(p["_buffer"]["_restore_keys"][0]),
            p["_buffer_seqs"].append(p["_next_seq"]),
        ),
        r"_buffer\._restore_keys\[\d+\]=.* must be unique: it is also _buffer\._restore_keys\[0\]",
    ),
    (
        "an extra restore key",
        lambda p: p["_buffer"]["_restore_keys"].append(_with_index(p, 59)),
        r"_buffer_seqs=\[.*\] must hold one seq per buffered restore key",
    ),
    (
        "an unknown seq pending",
        lambda p: p["_pending"].append([777]),
        r"_pending\[\d+\]\[0\]=777 must be a buffered seq",
    ),
    (
        "a seq pending twice",
        lambda p: p["_pending"].extend([[p["_buffer_seqs"][0]]] * 2),
        r"_pending\[\d+\]\[0\]=\d+ must (be pending once|not also)|_packer\.held\[\d+\]\.key=\d+ "
        r"must not also be pending",
    ),
    (
        "an unknown held key",
        lambda p: p["_packer"]["held"][0].__setitem__(0, 777),
        r"_packer\.held\[0\]\.key=777 must be a buffered seq",
    ),
    (
        "a restore key index out of range",
        lambda p: _webdataset_index(p, 10**6),
        r"_buffer\._restore_keys\[0\]=.* has sample index 1000000, not an int in \[0, 60\)",
    ),
    (
        "a restore key index of the wrong type",
        lambda p: _webdataset_index(p, "3"),
        r"_buffer\._restore_keys\[0\]=.* has sample index '3'",
    ),
    (
        "a restore key of another dataset",
        lambda p: p["_buffer"]["_restore_keys"].__setitem__(0, ("Webdataset", 3)),
        r"_buffer\._restore_keys\[0\]=\('Webdataset', 3\) must start with 'MapDataset'",
    ),
    (
        "a counter of the wrong type",
        lambda p: p["_counters"].__setitem__("samples", "3"),
        r"_counters\.samples='3' must be an int",
    ),
    (
        "a skip count of the wrong type",
        lambda p: p["_counters"]["skipped"].__setitem__("overlong", None),
        r"_counters\.skipped\.overlong=None must be an int",
    ),
    (
        "an audio counter without the other",
        lambda p: p["_counters"].pop("audio_tokens_max"),
        r"_counters=.* must be a dict with the keys",
    ),
    (
        "a most audio tokens per pack above their total",
        lambda p: p["_counters"].__setitem__("audio_tokens_max", 5),
        r"_counters\.audio_tokens_max=5 must be at most _counters\.audio_tokens \(0\)",
    ),
    (
        "a next seq below the buffered ones",
        lambda p: p.__setitem__("_next_seq", 0),
        r"_next_seq=0 must be above every buffered seq",
    ),
    (
        "a source_done that is not a bool",
        lambda p: p.__setitem__("_source_done", "no"),
        r"_source_done='no' must be a bool",
    ),
    (
        "an extra key",
        lambda p: p.__setitem__("_extra", 1),
        r"keys=.* unknown \['_extra'\]",
    ),
    (
        "a negative packer length",
        lambda p: p["_packer"]["held"][0].__setitem__(1, -1),
        r"_packer: packer state: held\[0\]\.length=-1 must be an int in \[1, 1024\]",
    ),
]


@pytest.mark.parametrize(
    ("change", "message"),
    [pytest.param(change, message, id=name) for name, change, message in STATE_TAMPERING],
)
def test_a_tampered_packing_state_is_refused_by_field_before_restoring(
    small_path: Path, carried_state: Any, change: Any, message: str
) -> None:
    state = tampered(carried_state, change)
    kept = pickle.dumps(state)
    for restore in (restore_state_rank, lambda loader, s: loader.restore_state_rank(s)):
        run = LoaderRun(small_path, **PENDING)
        with pytest.raises(ValueError, match=rf"^cannot restore the packing state.*{message}"):
            restore(run.loader, state)
    assert pickle.dumps(state) == kept


@pytest.mark.parametrize("worker_states", [[], None, "x"])
def test_empty_worker_states_are_refused_by_name(
    small_path: Path, carried_state: Any, worker_states: Any
) -> None:
    state = copy.deepcopy(carried_state)
    state.worker_states = worker_states
    with pytest.raises(ValueError, match=r"worker_states=.* must be a non-empty list"):
        restore_state_rank(LoaderRun(small_path, **PENDING).loader, state)


def test_another_dataset_with_the_same_shards_is_refused_by_name(
    tmp_path: Path, carried_state: Any
) -> None:
    other = small_dataset(tmp_path / "other", SMALL_SAMPLES + 1)  # shard-000000.tar too
    with pytest.raises(ValueError, match=r"dataset\.samples: saved 60, now 61"):
        restore_state_rank(LoaderRun(other, **PENDING).loader, carried_state)


def test_a_moved_copy_of_the_dataset_restores(
    tmp_path: Path, small_path: Path, carried_state: Any
) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(small_path, moved)
    expected = LoaderRun(small_path, **PENDING)
    expected.load(carried_state)
    resumed = LoaderRun(moved, **PENDING)
    restore_state_rank(resumed.loader, carried_state)
    assert [resumed.step()[0] for _ in range(10)] == [expected.step()[0] for _ in range(10)]


def test_a_state_without_the_dataset_identity_restores_with_a_warning(
    small_path: Path, carried_state: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def drop_identity(packing: dict[str, Any]) -> None:
        packing["settings"] = {
            k: v for k, v in packing["settings"].items() if not k.startswith("dataset.")
        }

    old = tampered(carried_state, drop_identity)
    expected = LoaderRun(small_path, **PENDING)
    expected.load(carried_state)
    state_check.warned["no_identity"] = False
    with caplog.at_level(logging.WARNING, logger="energon_pack.energon"):
        resumed = LoaderRun(small_path, **PENDING)
        restore_state_rank(resumed.loader, old)
        restore_state_rank(LoaderRun(small_path, **PENDING).loader, old)
    warnings = [r for r in caplog.records if "without the dataset's identity" in r.getMessage()]
    assert len(warnings) == 1
    assert [resumed.step()[0] for _ in range(5)] == [expected.step()[0] for _ in range(5)]


def test_a_state_saved_before_the_audio_counters_restores(
    small_path: Path, carried_state: Any
) -> None:
    def drop_audio(packing: dict[str, Any]) -> None:
        del packing["_counters"]["audio_tokens"], packing["_counters"]["audio_tokens_max"]

    expected = LoaderRun(small_path, **PENDING)
    expected.load(carried_state)
    resumed = LoaderRun(small_path, **PENDING)
    resumed.load(tampered(carried_state, drop_audio))
    assert [resumed.step()[0] for _ in range(5)] == [expected.step()[0] for _ in range(5)]
    (packing,) = packing_states(resumed.save())
    assert packing["_counters"]["audio_tokens"] == packing["_counters"]["audio_tokens_max"] == 0


@pytest.fixture(scope="module")
def pending_state(small_path: Path) -> Any:
    """A state with a chosen pack not yet yielded."""
    return first_state(small_path, "pending")


def test_a_seq_pending_twice_is_refused(small_path: Path, pending_state: Any) -> None:
    def twice(packing: dict[str, Any]) -> None:
        packing["_pending"].append([packing["_pending"][0][0]])

    state = tampered(pending_state, twice)
    with pytest.raises(ValueError, match=r"_pending\[\d+\]\[0\]=\d+ must be pending once"):
        restore_state_rank(LoaderRun(small_path, **PENDING).loader, state)


def test_pending_packs_that_do_not_fit_a_row_are_refused_once_read(
    small_path: Path, pending_state: Any
) -> None:
    def overfull(packing: dict[str, Any]) -> None:
        packing["_buffer"]["_restore_keys"].append(_with_index(packing, 53))  # 1000 tokens
        packing["_buffer_seqs"].append(packing["_next_seq"])
        packing["_pending"][-1].append(packing["_next_seq"])
        packing["_next_seq"] += 1

    run = LoaderRun(small_path, **PENDING)
    restore_state_rank(run.loader, tampered(pending_state, overfull))
    with pytest.raises(ValueError, match=r"_pending\[\d+\]=\[.*\] needs \d+ tokens, above seq"):
        run.step()


def test_a_buffered_sample_neither_held_nor_pending_is_refused(
    small_path: Path, carried_state: Any
) -> None:
    def lost(packing: dict[str, Any]) -> None:
        packing["_buffer"]["_restore_keys"].append(_with_index(packing, 59))
        packing["_buffer_seqs"].append(packing["_next_seq"])
        packing["_next_seq"] += 1

    with pytest.raises(ValueError, match=r"_buffer_seqs=.* \[\d+\] are neither"):
        restore_state_rank(LoaderRun(small_path, **PENDING).loader, tampered(carried_state, lost))


def test_a_held_length_that_is_not_the_samples_is_refused_once_read(
    small_path: Path, carried_state: Any
) -> None:
    def longer(packing: dict[str, Any]) -> None:
        packing["_packer"]["held"][0][1] += 1

    run = LoaderRun(small_path, **PENDING)
    restore_state_rank(run.loader, tampered(carried_state, longer))
    with pytest.raises(
        ValueError, match=r"_packer\.held\[0\]\.length=\d+, but its buffered sample"
    ):
        run.step()
