"""What the loader benchmarks share: reading a process's peak RSS from the kernel, and the
cells of their tables."""

from __future__ import annotations

from pathlib import Path


def vm_hwm(pid: int) -> int | None:
    """The kernel's peak RSS of ``pid`` in bytes (``VmHWM``), or None (gone, or not Linux)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def ratio_cell(value: float | None) -> str:
    """A ratio to three decimals, ``-`` where there is none."""
    return "-" if value is None else f"{value:.3f}"


def mib_cell(value: float | None) -> str:
    """MiB without decimals, ``-`` where there is none."""
    return "-" if value is None else f"{value:.0f}"
