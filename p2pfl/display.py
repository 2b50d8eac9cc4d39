"""What the user sees besides text: one way to draw a figure and one way to show progress.

Both are lazy (matplotlib and rich load only when a figure or a bar is made) so commands that
draw nothing start fast, and both are thread-safe by construction: figures live on their own Agg
canvas, never in pyplot's global state, so a figure drawn beside a simulation's threads (or in a
test) cannot pick up another's axes or backend.
"""

from __future__ import annotations

from typing import Any

__all__ = ["figure", "progress_bar"]


def figure(figsize: tuple[float, float] = (6, 4), nrows: int = 1, ncols: int = 1) -> tuple[Any, Any]:
    """A figure on its own Agg canvas (no pyplot state) and its axes (one, or an array for a grid)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    if nrows == ncols == 1:
        return fig, fig.add_subplot()
    return fig, fig.subplots(nrows, ncols)


def progress_bar(label: str, unit: str, *extra: Any, stderr: bool = False) -> Any:
    """A started rich progress bar: ``label``, the bar, done/total ``unit``, ``extra`` columns, elapsed time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    kw: dict[str, Any] = {}
    if stderr:
        from rich.console import Console

        kw["console"] = Console(stderr=True)
    bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit), *extra,
                   TimeElapsedColumn(), **kw)
    bar.start()
    return bar
