"""Qwen-VL image and video preprocessing with header-only probing, by concern.

* :mod:`~energon_pack.media.config`: settings, limits, probe results, sizing rules (no torch);
* :mod:`~energon_pack.media.errors`: :class:`MediaError` and the boundary that names a sample
  (no torch);
* :mod:`~energon_pack.media.decode`: native decoding with Pillow and decord (no torch; runs in
  the decoder process);
* :mod:`~energon_pack.media.guard`: the decoder process that turns native crashes and hangs
  into a :class:`MediaError`;
* :mod:`~energon_pack.media.sampling`: the video rules (``MediaConfig.video_rule``): sampled
  frames, grid, timestamps (no torch);
* :mod:`~energon_pack.media.probe`: grids and token counts from headers, :class:`Frames`;
* :mod:`~energon_pack.media.pixels`: patches, normalisation, :func:`normalize_pixels`;
* :mod:`~energon_pack.media.assembly`: a pack's media (:func:`decode_vision`,
  :class:`MediaTensors`);
* :mod:`~energon_pack.media.tokens`: a medium's vision tokens (:func:`vision_tokens`);
* :mod:`~energon_pack.media.audio`: the header of an audio file (:func:`probe_audio`: WAV,
  FLAC, MP3, Ogg Opus, M4A; no torch) or of a video's audio track (:func:`probe_video_audio`);
  :mod:`~energon_pack.media.audio_decode` its waveform,
  :mod:`~energon_pack.media.audio_tokens` its tokens for a processor.

Probing (:func:`probe_image`, :func:`probe_video`) reads only the container/image header and
returns the patch grid and the token count, so a packing buffer can hold compressed bytes and
decode (:func:`process_image`, :func:`process_video`) only the samples it selected.
"""

from typing import TYPE_CHECKING

from energon_pack._moved import renamed
from energon_pack.media.assembly import (
    MediaFootprint,
    MediaItem,
    MediaTensors,
    decode_vision,
    footprint,
    media_grids,
    tensor_nbytes,
)
from energon_pack.media.audio import AUDIO_EXTENSIONS, AudioProbe, probe_audio, probe_video_audio
from energon_pack.media.config import (
    IMAGE_EXTENSIONS,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    VIDEO_EXTENSIONS,
    ImageProbe,
    MediaConfig,
    PixelDtype,
    VideoProbe,
    smart_resize,
)
from energon_pack.media.errors import MediaError, MediaErrorKind
from energon_pack.media.pixels import normalize_pixels, process_frames, process_image, process_video
from energon_pack.media.probe import (
    Frames,
    FramesPlan,
    check_media_count,
    image_frames,
    media_kind,
    probe_frames,
    probe_image,
    probe_video,
)
from energon_pack.media.tokens import (
    VisionIds,
    timestamp_text,
    vision_block,
    vision_tokens,
)

__all__ = [
    "AUDIO_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "VIDEO_EXTENSIONS",
    "AudioProbe",
    "Frames",
    "FramesPlan",
    "ImageProbe",
    "MediaConfig",
    "MediaError",
    "MediaErrorKind",
    "MediaFootprint",
    "MediaItem",
    "MediaTensors",
    "PixelDtype",
    "VideoProbe",
    "VisionIds",
    "check_media_count",
    "decode_vision",
    "footprint",
    "image_frames",
    "media_grids",
    "media_kind",
    "normalize_pixels",
    "probe_audio",
    "probe_frames",
    "probe_image",
    "probe_video",
    "probe_video_audio",
    "process_frames",
    "process_image",
    "process_video",
    "smart_resize",
    "tensor_nbytes",
    "timestamp_text",
    "vision_block",
    "vision_tokens",
]

if TYPE_CHECKING:  # the old name, for type checkers
    VisionInputs = MediaTensors
    __all__ += ["VisionInputs"]
else:  # the old name, with a DeprecationWarning
    __getattr__ = renamed(__name__, "VisionInputs")
