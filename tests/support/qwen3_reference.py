"""transformers' Qwen3-VL processors as test references, run in a process of their own.

``Qwen3VLVideoProcessor`` (and the processor's fast image path) needs torchvision. The PyPI
build (0.28.0, installed with ``--no-deps`` into ``.venv/reference`` by ``scripts/venv.sh``,
outside ``sys.path``) imports against the CPU torch only once the operator schemas
``torchvision::nms`` and ``torchvision::qnms`` are defined. That happens in the child process
started here, so this test process (and every other test) never sees torchvision: transformers
here keeps its torchvision-free paths.

:func:`run_reference` sends jobs (pickled) to the child, which answers with plain numpy/list
results; :func:`write_model_dir` writes a model directory holding only processor/config JSON
files and the tokenizer, as a released Qwen3-VL checkpoint has them.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REFERENCE_DIR = Path(sys.prefix) / "reference"
"""Where ``scripts/venv.sh`` installs torchvision for the references."""

IMAGE_CONFIG = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
}
"""The released Qwen3-VL ``preprocessor_config.json`` settings."""
VIDEO_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}
"""The released Qwen3-VL ``video_preprocessor_config.json`` settings (fps and frame bounds
are the processor's defaults, written out)."""
MODEL_CONFIG = {
    "model_type": "qwen3_vl",
    "vision_config": {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
}


def available() -> bool:
    """Whether the reference torchvision is installed."""
    return (REFERENCE_DIR / "torchvision").is_dir()


def write_model_dir(directory: Path, **video_changes: Any) -> Path:
    """A Qwen3-VL model directory: config.json, both processor JSONs (``video_changes``
    applied to the video one) and the real Qwen tokenizer with the Qwen3-VL chat template."""
    from chat_templates import QWEN3_VL
    from real_qwen import real_qwen_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    real_qwen_tokenizer(chat_template=QWEN3_VL).save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(MODEL_CONFIG))
    (directory / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIG))
    video = {**VIDEO_CONFIG, **video_changes}
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video))
    return directory


def run_reference(model_dir: Path, jobs: list[dict[str, Any]], timeout: float = 600) -> list[Any]:
    """Each job's result from ``Qwen3VLProcessor.from_pretrained(model_dir)`` (or of the
    job's own ``"model_dir"``) in a child process."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REFERENCE_DIR), str(Path(__file__).parent)]),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, __file__, str(model_dir)],
        input=pickle.dumps(jobs),
        capture_output=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"reference process failed:\n{done.stderr.decode()[-4000:]}")
    if os.environ.get("QWEN3_REFERENCE_TIMES"):
        print(done.stderr.decode(), file=sys.stderr)
    results: list[Any] = pickle.loads(done.stdout)
    return results


# --- the child ----------------------------------------------------------------------------


def _import_torchvision() -> None:
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _import_torchvision.lib = lib  # type: ignore[attr-defined]  # keep the schemas alive
    import torchvision  # noqa: F401


def _video_job(processor: Any, job: dict[str, Any]) -> dict[str, Any]:
    """A clip from its file: all frames decoded by decord with decord's metadata, sampled by
    the processor (or, with ``job["fps"]``, given frames taken as they are at that rate). The
    user turn is ``job["before"]`` (optional), the video, ``job["prompt"]``."""
    import decord
    import numpy as np
    from transformers.video_utils import VideoMetadata

    options: dict[str, Any] = {}
    if "frames" in job:  # already sampled frames at a known rate
        frames = job["frames"]
        total, fps = len(frames), job["fps"]
        metadata = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=list(range(total)))
        options["do_sample_frames"] = False
    else:
        reader = decord.VideoReader(job["path"], num_threads=1)
        total, fps = len(reader), float(reader.get_avg_fps())
        frames = reader.get_batch(list(range(total))).asnumpy()
        metadata = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
    before = [{"type": "text", "text": job["before"]}] if job.get("before") else []
    user = [*before, {"type": "video"}, {"type": "text", "text": job["prompt"]}]
    messages = [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": job["answer"]}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    out = processor(
        text=[text],
        videos=[frames],
        video_metadata=[metadata],
        return_metadata=True,
        return_tensors="np",
        **options,
    )
    result = {
        "text": text,
        "input_ids": out["input_ids"][0].tolist(),
        "video_grid_thw": out["video_grid_thw"].tolist(),
        "frames_indices": [int(i) for i in out["video_metadata"][0].frames_indices],
        "total": total,
        "fps": fps,
    }
    if job.get("pixels"):
        result["pixel_values_videos"] = np.asarray(out["pixel_values_videos"], dtype=np.float32)
    return result


def _image_job(processor: Any, job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from PIL import Image

    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": job["prompt"]}]},
        {"role": "assistant", "content": [{"type": "text", "text": job["answer"]}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    image = Image.open(job["path"])
    out = processor(text=[text], images=[image], return_tensors="np")
    return {
        "input_ids": out["input_ids"][0].tolist(),
        "image_grid_thw": out["image_grid_thw"].tolist(),
        "pixel_values": np.asarray(out["pixel_values"], dtype=np.float32),
    }


def _rule_job(processor: Any, job: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
    """The processor's own sampling and timestamp rule for each ``(fps, frames)`` pair."""
    from transformers.video_utils import VideoMetadata

    video = processor.video_processor
    out = []
    for fps, total in job["pairs"]:
        metadata = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
        indices = [int(i) for i in video.sample_frames(metadata)]
        seconds = processor._calculate_timestamps(list(indices), fps, video.temporal_patch_size)
        out.append((indices, [float(s) for s in seconds]))
    return out


def _main() -> None:
    _import_torchvision()
    from transformers import Qwen3VLProcessor

    processors: dict[str, Any] = {}
    jobs = pickle.loads(sys.stdin.buffer.read())
    handlers = {"video": _video_job, "image": _image_job, "rule": _rule_job}
    results = []
    for job in jobs:
        model_dir = job.get("model_dir", sys.argv[1])
        if model_dir not in processors:
            processors[model_dir] = Qwen3VLProcessor.from_pretrained(model_dir)
        try:
            start = time.perf_counter()
            results.append(handlers[job["kind"]](processors[model_dir], job))
            if os.environ.get("QWEN3_REFERENCE_TIMES"):
                print(
                    f"{time.perf_counter() - start:.2f}s {job.get('path', job['kind'])}",
                    file=sys.stderr,
                )
        except Exception as exc:
            raise RuntimeError(f"reference job {job.get('path', job['kind'])} failed") from exc
    sys.stdout.buffer.write(pickle.dumps(results))


if __name__ == "__main__":
    _main()
