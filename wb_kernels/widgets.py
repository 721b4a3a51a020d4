"""The ipywidgets wiring every lesson's slider shares (lessons 01-06).

The logic behind a slider is a plain function (inputs -> data or a figure) in its rung's
``stages/<rung>/slider.py``, which pytest calls without a browser; a lesson wires it to a slider with
:func:`sequence_length_slider` and :func:`link_slider`.
"""

from __future__ import annotations

__all__ = ["sequence_length_slider", "link_slider"]


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
    import ipywidgets as widgets
    from IPython.display import display

    output = widgets.Output()
    status = widgets.Label()  # says that work is under way: on the simulator a redraw can take seconds

    def redraw(change=None):
        status.value = f"computing for {slider.description} = {slider.value} …"
        try:
            with output:
                output.clear_output(wait=True)
                display(draw(slider.value))
        finally:
            status.value = ""

    slider.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([slider, status]), output])
