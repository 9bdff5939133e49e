"""The ``energon-pack`` command line.

Every error ends in one line on stderr, ``energon-pack: error: ...``, naming the flag or path,
and the exit status says what failed: 1 rule violations (``check-config``), 2 a bad argument,
input or setting, 3 a failed read or write (full disk, file-size limit, read-only or missing
folder, a file where a folder is expected or the reverse, no permission), 130 Ctrl-C (``tune``).
"""

from energon_pack.cli.exits import EXIT_IO, EXIT_USAGE, EXIT_VIOLATIONS
from energon_pack.cli.parser import build_parser, main

__all__ = ["EXIT_IO", "EXIT_USAGE", "EXIT_VIOLATIONS", "build_parser", "main"]
