"""Moved: the native format's parser is :mod:`energon_pack.formats.native`."""

from energon_pack.formats.native import load_json, parse_sample
from energon_pack.formats.raw import RawSample

__all__ = ["RawSample", "load_json", "parse_sample"]
