"""Head x head heat maps that read at 30 layers and beyond: layer blocks, and the zoom into one block.

A composition matrix has one row per earlier head and one column per later head: 261 x 261 cells for SmolLM2
(30 layers x 9 heads), which no screen shows cell by cell. Past EVERY_LABEL_MAX rows the page draws instead
  * the block map: one cell per (earlier layer, later layer), its value the strongest pair of the block (the
    largest score − baseline), which pair that is on hover; a click opens the block;
  * the block: the heads of one earlier layer x the heads of one later layer, each cell's value written in it,
    a click opening the pair.
Both use the same colour range as the full matrix (±zmax shared by Q, K and V), so a block's colours compare.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from app import charts
from app.figure_output import MAX_HEIGHT

HEAD_NAME = re.compile(r"^L(\d+)H(\d+)$")


def layer_of(name: str) -> int:
    m = HEAD_NAME.match(name)
    if m is None:
        raise ValueError(f"not a head name: {name!r}")
    return int(m.group(1))


def layers(names: Sequence[str]) -> list[int]:
    """The distinct layers of `names`, in order."""
    return sorted({layer_of(n) for n in names})


def needs_blocks(n_rows: int) -> bool:
    """Whether a head x head matrix of n_rows rows is drawn as layer blocks (its rows could not each be labelled)."""
    return n_rows > charts.EVERY_LABEL_MAX


def strongest_by_block(
    z: Sequence[Sequence[float | None]], rows: Sequence[str], cols: Sequence[str]
) -> dict[tuple[int, int], tuple[float, str, str]]:
    """(row layer, column layer) -> (largest value, its row head, its column head), over the cells that have one."""
    best: dict[tuple[int, int], tuple[float, str, str]] = {}
    row_layer, col_layer = [layer_of(r) for r in rows], [layer_of(c) for c in cols]
    for i, row in enumerate(z):
        for j, v in enumerate(row):
            if v is None:
                continue
            key = (row_layer[i], col_layer[j])
            if key not in best or v > best[key][0]:
                best[key] = (v, rows[i], cols[j])
    return best


def composition_block_map(view: Any, zmax: float | None, block_url: Callable[[int, int], str]) -> charts.Figure:
    """One cell per (earlier layer, later layer): the strongest pair's score − baseline; a click opens the block."""
    src_layers, dst_layers = layers(view.sources), layers(view.targets)
    best = strongest_by_block(view.minus_baseline, view.sources, view.targets)
    z: list[list[float | None]] = []
    custom: list[list[list[str]]] = []
    links: list[list[str | None]] = []
    for a in src_layers:
        z.append([best[(a, b)][0] if (a, b) in best else None for b in dst_layers])
        custom.append([[best[(a, b)][1], best[(a, b)][2]] if (a, b) in best else ["", ""] for b in dst_layers])
        links.append([block_url(a, b) if (a, b) in best else None for b in dst_layers])
    fig = charts.heatmap(
        z,
        [f"L{b}" for b in dst_layers],
        [f"L{a}" for a in src_layers],
        title=f"{view.kind}-composition − baseline, strongest pair per layer block (click one)",
        x_title="later layer (reads)",
        y_title="earlier layer (writes)",
        signed=True,
        zmax=zmax,
        customdata=custom,
        hover="%{y} → %{x}: strongest pair %{customdata[0]} → %{customdata[1]}<br>minus baseline %{z:+.4f}",
        links=links,
        colorbar="score − baseline",
        height=min(MAX_HEIGHT, max(320, 30 * len(src_layers) + 170)),
    )
    return fig


def composition_block(
    view: Any, model_id: str, zmax: float | None, source_layer: int, target_layer: int
) -> charts.Figure | None:
    """The heads of one earlier layer x the heads of one later layer, values in the cells; a click opens the pair.
    None when the block holds no pair."""
    rows = [i for i, s in enumerate(view.sources) if layer_of(s) == source_layer]
    cols = [j for j, t in enumerate(view.targets) if layer_of(t) == target_layer]
    if not any(view.scores[i][j] is not None for i in rows for j in cols):
        return None  # no pair: the earlier layer is not below the later one, or a layer is outside the model
    sources = [view.sources[i] for i in rows]
    targets = [view.targets[j] for j in cols]
    z = [[view.minus_baseline[i][j] for j in cols] for i in rows]
    custom = [[[view.scores[i][j]] for j in cols] for i in rows]
    links = [
        [
            f"/models/{model_id}/composition/{s}/{t}" if view.scores[i][j] is not None else None
            for j, t in zip(cols, targets, strict=True)
        ]
        for i, s in zip(rows, sources, strict=True)
    ]
    return charts.heatmap(
        z,
        targets,
        sources,
        title=f"layer {source_layer} → layer {target_layer}: {view.kind}-composition − baseline (click a pair)",
        x_title="later head (reads)",
        y_title="earlier head (writes)",
        signed=True,
        zmax=zmax,
        customdata=custom,
        hover="%{y} → %{x}<br>" + view.kind + "-composition %{customdata[0]:.4f}<br>minus baseline %{z:+.4f}",
        links=links,
        colorbar="score − baseline",
        text_in_cells=charts.cells_fit(len(sources), len(targets)),
        cell_format="%{z:.2f}",
        height=max(280, 40 * len(sources) + 160),
    )
