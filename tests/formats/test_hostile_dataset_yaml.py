"""A dataset's description names code (issue 35, item 3): ``energon-pack tune`` refuses it.

Energon imports and calls whatever a ``dataset.yaml`` names (``__module__`` / ``__class__`` /
``__function__``) and runs ``sample_loader`` files of the dataset. energon_pack's commands
refuse anything but Energon's and energon_pack's sample types unless ``--trust-dataset-code``
is passed; the attacks that would run code run in a child process, which must not create its
marker file (and does, with the flag: the flag really hands the dataset to Energon).
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from energon_pack.cli import main
from energon_pack.formats.dataset_trust import check_dataset_code
from energon_pack.tune import TuneSettings, run_once

SEED = 20261201
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory, vlm_demo_path: Path) -> Path:
    """A copy of ``fixtures/vlm_demo``; each test writes its own description beside
    ``dataset.yaml`` and names it with ``--dataset-config``."""
    root = tmp_path_factory.mktemp("hostile") / "vlm_demo"
    shutil.copytree(vlm_demo_path, root)
    return root


def _describe(dataset: Path, text: str) -> str:
    """Write ``text`` as a new description of ``dataset``; its file name."""
    name = f"attack{random.Random(f'{SEED}{text}').randrange(10**9)}.yaml"
    (dataset / ".nv-meta" / name).write_text(text)
    return name


def _tune(dataset: Path, config: str, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = ["tune", str(dataset), "--dataset-config", config, "--buffer-sizes", "4"]
    argv += ["--num-workers", "0", "--max-samples", "2", "--out", str(out), *flags]
    return subprocess.run(
        [sys.executable, "-m", "energon_pack.cli", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


def _run_system(marker: Path) -> str:
    """``os.system`` nested where Energon's parser calls it (it exits 0 there)."""
    return (
        "__module__: megatron.energon\n__class__: CrudeWebdataset\nsubflavors:\n  x:\n"
        f"    __module__: os\n    __function__: system\n    command: touch {marker}\n"
    )


@pytest.mark.parametrize("where", ["root", "nested"])
def test_a_description_that_runs_a_command_is_refused(
    dataset: Path, tmp_path: Path, where: str
) -> None:
    marker = tmp_path / "marker"
    text = (
        f"__module__: os\n__function__: system\ncommand: touch {marker}\n"
        if where == "root"
        else _run_system(marker)
    )
    done = _tune(dataset, _describe(dataset, text), tmp_path / "out")
    assert done.returncode == 2, done.stderr[-2000:]
    assert not marker.exists()
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"energon-pack: error: {dataset / '.nv-meta'}")
    assert "names the function os.system" in line
    assert "--trust-dataset-code" in line
    assert "Traceback" not in done.stderr


def test_trust_dataset_code_hands_the_description_to_energon(dataset: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    done = _tune(dataset, _describe(dataset, _run_system(marker)), tmp_path / "out")
    assert done.returncode == 2
    assert not marker.exists()
    trusted = _tune(
        dataset, _describe(dataset, _run_system(marker)), tmp_path / "out2", "--trust-dataset-code"
    )
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert marker.exists()  # Energon's rules: the dataset's code ran


def test_a_description_naming_another_module_imports_nothing(dataset: Path, tmp_path: Path) -> None:
    done = _tune(dataset, _describe(dataset, "__module__: this\n__class__: Zen\n"), tmp_path)
    assert done.returncode == 2
    assert "Beautiful is better than ugly" not in done.stdout + done.stderr  # `this` not run
    assert "names this.Zen, outside megatron.energon and energon_pack" in done.stderr


def test_a_sample_loader_file_of_the_dataset_is_not_run(dataset: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    (dataset / ".nv-meta" / "loader.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "def sample_loader(raw):\n    return raw\n"
        "def part_filter(part):\n    return True\n"
    )
    text = (
        "__module__: megatron.energon\n__class__: CaptioningWebdataset\n"
        "sample_loader: loader.py:sample_loader\npart_filter: loader.py:part_filter\n"
    )
    done = _tune(dataset, _describe(dataset, text), tmp_path / "out")
    assert done.returncode == 2
    assert not marker.exists()
    assert "root.sample_loader names the Python file 'loader.py:sample_loader'" in done.stderr


def test_an_unknown_class_is_one_line_not_a_traceback(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _describe(dataset, "__module__: megatron.energon\n__class__: NoSuchWebdataset\n")
    argv = ["tune", str(dataset), "--dataset-config", config, "--buffer-sizes", "4"]
    argv += ["--num-workers", "0", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "names megatron.energon.NoSuchWebdataset, which is not there" in err
    assert "__class__: CrudeWebdataset" in err  # the fix
    assert main([*argv, "--trust-dataset-code"]) == 2  # Energon's own error, as one line
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("energon-pack")]
    assert "cannot open the dataset" in line
    assert "NoSuchWebdataset" in line
    assert "Traceback" in (tmp_path / "out" / "tune-error.log").read_text()


def test_tunes_library_entry_refuses_too(dataset: Path, tmp_path: Path) -> None:
    config = _describe(dataset, "__module__: os\n__function__: getcwd\n")
    settings = TuneSettings(str(dataset), dataset_config=config, num_workers=0)
    with pytest.raises(ValueError, match=r"names the function os\.getcwd"):
        run_once(settings, 4, "lazy", tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("__module__: megatron.energon\n__class__: get_train_dataset\n", "which is no class"),
        ("__module__: energon_pack.cli.__main__\n__class__: X\n", "which Energon does not load"),
        ("__module__: megatron.energon.nothing_here\n__class__: X\n", "does not load itself"),
        ("__module__: megatron.energon.dataset_config\n__class__: Path\n", "defined in pathlib"),
        ("__module__: [os]\n__class__: system\n", "__module__ ['os']"),
        (
            "__module__: megatron.energon\n__class__: CrudeWebdataset\nx: [{__function__: f}]\n",
            "root.x[0] names the function None.f",
        ),
        (
            "__module__: megatron.energon\n__class__: CrudeWebdataset\npart_filter: f.py\n",
            "root.part_filter",
        ),
    ],
)
def test_what_a_description_may_name(dataset: Path, text: str, message: str) -> None:
    config = _describe(dataset, text)
    with pytest.raises(ValueError, match=re.escape(str(dataset / ".nv-meta" / config))) as error:
        check_dataset_code(dataset, config)
    assert message in str(error.value)
    assert str(dataset / ".nv-meta" / config) in str(error.value)


def test_the_shipped_descriptions_pass(fixtures_dir: Path) -> None:
    for name in ("vlm_demo", "bridge_qwenvl", "broken"):
        check_dataset_code(fixtures_dir / name)
    for layout in ("llava", "mantis", "text", "tutorial"):
        check_dataset_code(fixtures_dir / "bridge_layouts" / layout, "crude.yaml")
        try:
            import megatron.bridge  # noqa: F401
        except ImportError:
            with pytest.raises(ValueError, match="Bridge is not installed; install"):
                check_dataset_code(fixtures_dir / "bridge_layouts" / layout)
        else:
            check_dataset_code(fixtures_dir / "bridge_layouts" / layout)


def test_a_metadataset_is_checked_with_every_dataset_it_references(
    dataset: Path, tmp_path: Path
) -> None:
    evil = _describe(dataset, "__module__: os\n__function__: system\ncommand: 'true'\n")
    blend = tmp_path / "blend.yaml"
    head = "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
    entry = "      - weight: 1\n        path: {}\n"
    blend.write_text(head + "    blend:\n" + entry.format(dataset))
    check_dataset_code(blend)
    blend.write_text(
        head
        + "    blend:\n"
        + entry.format(dataset)
        + entry.format(dataset)
        + f"        dataset_config: {evil}\n"
    )
    with pytest.raises(ValueError, match=f"{dataset / '.nv-meta' / evil}: root names the function"):
        check_dataset_code(blend)
    nested = tmp_path / "outer.yaml"
    nested.write_text(head + "    path: blend.yaml\n")
    with pytest.raises(ValueError, match=r"names the function os\.system"):
        check_dataset_code(nested)
    nested.write_text(head + "    path: msc://bucket/data\n")
    with pytest.raises(ValueError, match="remote dataset 'msc://bucket/data'"):
        check_dataset_code(nested)
    loop = tmp_path / "loop.yaml"
    loop.write_text(head + "    path: loop.yaml\n")
    check_dataset_code(loop)  # each description is read once
