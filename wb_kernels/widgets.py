"""The ipywidgets wiring every lesson's slider shares (lessons 01-07).

The logic behind a slider is a plain function (inputs -> data or a figure) in its rung's
``stages/<rung>/slider.py``, which pytest calls without a browser; a lesson wires it to a slider with
:func:`sequence_length_slider` and :func:`link_slider`.
"""

from __future__ import annotations

import sys
import time

__all__ = ["sequence_length_slider", "link_slider", "link_sliders", "progress"]


def sequence_length_slider(values, value=None, description="L"):
    """A slider over a fixed list of sequence lengths (powers of two read better than a range)."""
    import ipywidgets as widgets

    values = list(values)
    return widgets.SelectionSlider(options=values, value=value if value is not None else values[len(values) // 2],
                                   description=description, continuous_update=False)


def link_slider(slider, draw):
    """Show ``draw(L)`` (a matplotlib Figure or anything displayable) below `slider`, redrawn on change.

    Returns the widget to display. `draw` runs in the callback, so an exception there surfaces in the
    output area (and the browser test sees it) instead of vanishing.
    """
    return link_sliders([slider], draw)


def link_sliders(sliders, draw):
    """Like :func:`link_slider` for several sliders side by side: ``draw(*values)`` in the sliders' order."""
    import ipywidgets as widgets
    from IPython.display import display

    sliders = list(sliders)
    output = widgets.Output()
    status = widgets.Label()  # says that work is under way: on the simulator a redraw can take seconds

    def redraw(change=None):
        status.value = "computing for " + ", ".join(f"{s.description} = {s.value}" for s in sliders) + " …"
        try:
            with output:
                output.clear_output(wait=True)
                display(draw(*(s.value for s in sliders)))
        finally:
            status.value = ""

    for slider in sliders:
        slider.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([*sliders, status]), output])


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def progress(items, *, description: str = "", unit: str = "it", disable: bool = False):
    """Iterate over `items` showing progress (long work: a cold CUDA build, a benchmark sweep, CPU timings).

    In a notebook: a progress bar that, when the loop ends, leaves one line of text in its place ("description:
    3/3 in 2.1 s"), so that a saved lesson shows what happened instead of a bar frozen at 0 % (a widget's state is
    not saved with the notebook). In a terminal: tqdm's bar on stderr. `disable` iterates silently."""
    items = list(items)
    if disable:
        yield from items
        return
    if not _in_notebook():
        from tqdm import tqdm

        yield from tqdm(items, desc=description, unit=unit, file=sys.stderr, dynamic_ncols=True)
        return
    import ipywidgets as widgets
    from IPython.display import display

    bar = widgets.IntProgress(value=0, min=0, max=len(items), description=description,
                              style={"description_width": "initial"})
    count = widgets.Label(f"0/{len(items)} {unit}")
    handle = display(widgets.HBox([bar, count]), display_id=True)
    start, done = time.perf_counter(), 0
    try:
        for item in items:
            yield item
            done += 1
            bar.value, count.value = done, f"{done}/{len(items)} {unit}"
    finally:
        text = (f"{description}: {done}/{len(items)} {unit} in {time.perf_counter() - start:.1f} s"
                + ("" if done == len(items) else " (stopped early)"))
        handle.update({"text/plain": text}, raw=True)  # raw: the line itself, not the repr of a string
