"""The load every snippet starts with, and the pieces of code several snippets share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HEADER = """import torch
from circuits_core.formats.checkpoint import load_checkpoint

loaded = load_checkpoint({folder!r}, dtype=torch.{dtype}{process})  # {basis}
model = loaded.model
"""


def load_lines(folder: Path, dtype: str, raw: bool = False) -> str:
    """The load: processed as the server serves it, or (raw) the weights as stored (the basis picker's 'raw')."""
    if raw:
        return HEADER.format(folder=str(folder), dtype=dtype, process=", process=False", basis="raw weights, as stored")
    return HEADER.format(folder=str(folder), dtype=dtype, process="", basis="processed as the server serves it")


def script(folder: Path, dtype: str, body: str, raw: bool = False) -> str:
    """A declared snippet (the `body` an Analysis.snippet below returns) after the model's load, printing `result`."""
    return load_lines(folder, dtype, raw) + body + "print(result)\n"


def token_ids(view: Any) -> list[int]:
    """The token ids of a view's `tokens`, as the page used them."""
    return [t.id for t in view.tokens]


TOP_K_IMPORT = "from circuits_core.ranking import top_k  # torch's topk, equal values by index (the lower first)\n"


def ranked_line(line: str, token: int, k: int) -> str:
    """One token's line of a token circuit (`line`: the code of a [d_vocab] tensor), ranked over `ids` (every token
    when None), as the `entries` of a table: (row, col) is (token, other) on a row, (other, token) on a column."""
    return f"""{TOP_K_IMPORT}with torch.no_grad():
    line = {line}  # [d_vocab]
if ids is not None:  # rank only the token set
    line = torch.full_like(line, float("-inf")).index_copy(0, ids, line[ids])
values, others = top_k(line, {k})
tokens = torch.full_like(others, {token})
"""
