"""A matplotlib figure on the Agg canvas (no display, nothing global touched), and its atomic save:
shared by every plot module of the report."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 110


def figure(width: float = 7.0, height: float = 4.0, ncols: int = 1):
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes


def save(fig: Figure, path: Path) -> Path:
    """Drawn in memory, then written atomically: a full disk leaves the old plot or none, never a
    0-byte PNG that the report would link to."""
    import io

    from moebench.fileio import atomic_write_bytes

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(Path(path), buf.getvalue())
    return path


