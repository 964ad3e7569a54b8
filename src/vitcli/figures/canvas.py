"""A figure to draw on, with matplotlib imported only then: a run imports figures.curves to draw its
curves at the end, and importing matplotlib costs seconds (4.4 s measured under load) the training
should not wait for. Object-oriented matplotlib (a Figure, no pyplot): no global state, no display
backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(**kwargs: Any) -> Figure:
    """matplotlib's Figure(**kwargs)."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)
