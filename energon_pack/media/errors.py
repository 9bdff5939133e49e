"""Media errors and the boundary that names the sample (no torch: the decoder process loads it).

Code that reads a medium raises :class:`MediaFailure` (a kind and a cause, no names). The
boundary that knows which sample and member it handles (:func:`media_errors`, :func:`naming`,
the public probe/process functions, the decoder guard) turns it into a :class:`MediaError`
that names them, once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

__all__ = [
    "FallbackKind",
    "MediaError",
    "MediaErrorKind",
    "MediaFailure",
    "failures",
    "labelled",
    "media_errors",
    "medium_label",
    "naming",
]

MediaErrorKind = Literal[
    "empty",  # zero-byte member
    "unreadable",  # header cannot be parsed (not an image / video)
    "corrupt",  # header parsed but pixel decoding failed (e.g. truncated file)
    "too_large",  # declared pixel count above the bomb guard
    "aspect_ratio",  # aspect ratio above 200 (smart_resize limit)
    "too_many",  # more media in one sample than allowed
    "too_long",  # video longer than the frame / duration limit
    "unsupported",  # member extension is not a known image/video type
    "bad_sample",  # sample JSON missing or malformed
    "crashed",  # the decoder died (e.g. SIGSEGV / SIGABRT in decord) on this member
    "timeout",  # the decoder did not finish within decode_timeout_s
    "placeholder_mismatch",  # <image>/<video> placeholders do not match the media members
]
FallbackKind = Literal["unreadable", "corrupt", "bad_sample"]
"""The kind an unexpected exception (not a :class:`MediaFailure`) is given at a boundary."""


class MediaError(ValueError):
    """A sample's media cannot be used; the message names the sample key, member and cause.

    ``position`` is the index of the failing sample in the list a batch call was given
    (:func:`~energon_pack.media.decode_vision`; keys may repeat), else ``None``.
    """

    def __init__(
        self,
        key: str,
        member: str,
        kind: MediaErrorKind,
        cause: str,
        position: int | None = None,
    ) -> None:
        super().__init__(f"sample {key!r}, member {member!r}: {cause} [{kind}]")
        self.key = key
        self.member = member
        self.kind: MediaErrorKind = kind
        self.cause = cause
        self.position = position

    def __reduce__(
        self,
    ) -> tuple[type[MediaError], tuple[str, str, MediaErrorKind, str, int | None]]:
        return type(self), (self.key, self.member, self.kind, self.cause, self.position)


class MediaFailure(Exception):
    """A medium cannot be used, not yet named: the boundary makes it a :class:`MediaError`."""

    def __init__(self, kind: MediaErrorKind, cause: str) -> None:
        super().__init__(f"{cause} [{kind}]")
        self.kind: MediaErrorKind = kind
        self.cause = cause

    def __reduce__(self) -> tuple[type[MediaFailure], tuple[MediaErrorKind, str]]:
        return type(self), (self.kind, self.cause)

    def named(self, key: str, member: str, position: int | None = None) -> MediaError:
        """This failure as the :class:`MediaError` of sample ``key``, member ``member``."""
        return MediaError(key, member, self.kind, self.cause, position)


_LABEL: ContextVar[str] = ContextVar("energon_pack_medium", default="?/?")


def medium_label() -> str:
    """``key/member`` of the medium the enclosing boundary handles (for log lines)."""
    return _LABEL.get()


@contextmanager
def labelled(label: str) -> Iterator[None]:
    """Log lines of the block name the medium ``label`` (see :func:`medium_label`)."""
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


@contextmanager
def failures(kind: FallbackKind) -> Iterator[None]:
    """Turn an unexpected exception of the block into ``MediaFailure(kind)``.

    The exception type goes into the cause (Pillow's ``KeyError``, a ``numpy`` error, decord's
    own errors). ``MediaError`` and ``MediaFailure`` pass; ``MemoryError`` and
    ``KeyboardInterrupt`` (resource errors, not bad data) propagate.
    """
    try:
        yield
    except (MediaError, MediaFailure, MemoryError):
        raise
    except Exception as exc:
        raise MediaFailure(kind, f"{type(exc).__name__}: {exc}") from exc


@contextmanager
def naming(key: str, member: str, *, position: int | None = None) -> Iterator[None]:
    """Name the block's :class:`MediaFailure`: it is raised as ``MediaError(key, member, ...)``
    (with ``position``), with the failure's traceback and cause. Other exceptions pass."""
    with labelled(f"{key}/{member}"):
        try:
            yield
        except MediaFailure as failure:
            error = failure.named(key, member, position)
            raise error.with_traceback(failure.__traceback__) from failure.__cause__


@contextmanager
def media_errors(
    key: str, member: str, kind: FallbackKind, *, position: int | None = None
) -> Iterator[None]:
    """The boundary of one medium: any exception of the block names the sample.

    A :class:`MediaFailure` becomes ``MediaError(key, member, ...)``, any other exception a
    ``MediaError`` of ``kind`` (see :func:`failures`); a ``MediaError`` passes unchanged.
    ``MemoryError`` and ``KeyboardInterrupt`` propagate, re-raised as the same type with the
    sample named.
    """
    try:
        with naming(key, member, position=position), failures(kind):
            yield
    except (MemoryError, KeyboardInterrupt) as exc:
        raise type(exc)(f"sample {key!r}, member {member!r}: {exc}") from exc
