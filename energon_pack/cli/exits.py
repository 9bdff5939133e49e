"""The exit statuses of ``energon-pack`` (light: the parser reads them before any command is
imported)."""

EXIT_VIOLATIONS = 1
"""``check-config`` found a violated rule."""
EXIT_USAGE = 2
"""A bad argument, input or setting."""
EXIT_IO = 3
"""A failed read or write."""
