"""What every figure goes through on its way to a page (the `for_page` filter of the chart macro): strings
escaped for plotly's HTML subset and the height capped.

Plotly draws axis labels, hover text, legends and titles through a small HTML subset (<b>, <i>, <br>, <a>,
<sub>, <sup>, <span>, &entities;), so a token '<b>x</b><br>' would be drawn bold with a line break. Every data
string (x, y, text, customdata, trace names, tick texts) and every title is escaped here, once, for all charts;
hover templates are the app's own and keep their markup.
"""

from __future__ import annotations

from typing import Any

Figure = dict[str, Any]

MAX_HEIGHT = (
    900  # px: no figure is taller; a heatmap with more rows than fit shows layer blocks (app/block_heatmaps.py)
)
PLOTLY_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})
TEXT_KEYS = ("x", "y", "text", "customdata", "name", "ticktext")


def plotly_text(value: Any) -> Any:
    """A string (or nested list of them) with plotly's HTML subset (<b>, <br>, <a>, &entities;) escaped, so a
    token such as '<b>x</b><br>' is drawn as those characters; numbers and None pass through."""
    if isinstance(value, str):
        return value.translate(PLOTLY_ESCAPES)
    if isinstance(value, list):
        return [plotly_text(v) for v in value]
    return value


def _escaped_title(node: Any) -> None:
    if isinstance(node, dict) and isinstance(node.get("title"), dict) and isinstance(node["title"].get("text"), str):
        node["title"] = {**node["title"], "text": plotly_text(node["title"]["text"])}


def for_page(fig: Figure) -> Figure:
    """The figure as a page draws it: every data string and title escaped for plotly's HTML subset (hover
    templates, which are ours, keep their markup) and its height capped at MAX_HEIGHT. A copy; `fig` is kept."""
    data = [{**t, **{k: plotly_text(t[k]) for k in TEXT_KEYS if k in t}} for t in fig.get("data", [])]
    layout: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in fig.get("layout", {}).items()}
    _escaped_title(layout)
    for key, axis in layout.items():
        if key.startswith(("xaxis", "yaxis")):
            _escaped_title(axis)
            if "ticktext" in axis:
                axis["ticktext"] = plotly_text(axis["ticktext"])
    if "annotations" in layout:
        layout["annotations"] = [{**a, "text": plotly_text(a.get("text", ""))} for a in layout["annotations"]]
    height = layout.get("height")
    if isinstance(height, int | float):
        layout["height"] = min(height, MAX_HEIGHT)
    return {**fig, "data": data, "layout": layout}
