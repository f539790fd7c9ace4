"""Where each source token's own logit ranks in its row of a token circuit (the self-copy shares of docs/maths.md
§2.8), counted exactly without forming every row whole when most rows are settled early.

Row a of a full OV circuit M [r rows, n columns] holds the logit effect of attending to token a; its own entry is
M[a, own(a)]. The self-copy shares need, per row, the number of other columns whose entry is above the row's own,
capped at k: 0 means top-1, below k means top-k. A row with at least k columns above its own is settled as soon as k
such columns are seen, whichever they are: counting more cannot change the capped number. So `count_above`
  1. probes every row on PROBE columns drawn at random (seeded): a row with k of them above its own entry is settled
     at k (k columns above are k columns above, among all n as among these);
  2. scans every column, in blocks growing from FIRST_BLOCK, for the rows left, counting anew, and drops each row
     from the next block once its count reaches k.
A head that does not copy settles most of its rows in step 1 (its own logit is seldom among a row's few largest);
a copying head's rows are scanned whole, as before. The count is exact: no column is skipped for a row that is not
settled by columns really above it. Ties are not counted (an entry equal to the row's own is not above it), and the
row's own column never counts for it.

Rows are asked of the caller's `logits(rows, columns)`, which forms only the block asked (the full OV circuit: the
cheaper of x W_OV then W_U's columns, or the rows' x W_V against (W_O W_U)'s columns; copying.row_ranks), so the
work follows what is still unsettled; the caller prices the most it can cost (every row probed, then scanned whole).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.cost import check_stop
from circuits_core.schedule import give_way

PROBE = 512  # columns of the first, random probe (seeded): ~2 % of a row above its own settles it at k = 10
FIRST_BLOCK = 2048  # columns of the first block of the whole scan; each next block twice as many, within the budget
PROBE_SEED = 0

# (row positions [a] into the caller's rows, column positions [c] or a slice into its n columns) -> logits [a, c]
Logits = Callable[[Tensor, Tensor | slice], Tensor]


def probe_columns(n: int, seed: int = PROBE_SEED) -> Tensor | None:
    """The PROBE column positions of step 1 [PROBE] (the first of torch.randperm(n) from seed); None when n <= PROBE
    (then the scan alone is cheaper)."""
    if n <= PROBE:
        return None
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:PROBE]


def count_above(
    logits: Logits,
    own_logit: Tensor,
    own: Tensor,
    n: int,
    k: int,
    block_bytes: int,
    itemsize: int = 4,
    first_block: int = FIRST_BLOCK,
    probe: Tensor | None = None,
) -> Tensor:
    """[r] int64: per row, the columns (of n) whose logit is above the row's own `own_logit` [r], capped at k; `own`
    [r] the position of each row's own column (never counted). A block of logits (`itemsize` bytes each) and its
    two masks stay within `block_bytes`; `probe` [p] column positions of step 1 (probe_columns(n): None skips it)."""
    r = int(own_logit.shape[0])
    rows = torch.arange(r)
    if probe is not None and r:
        rows = unsettled_by_probe(logits, own_logit, own, k, block_bytes, itemsize, probe)
    above = torch.full((r,), k, dtype=torch.int64)
    above[rows] = scan(logits, own_logit, own, rows, n, k, block_bytes, itemsize, first_block).above
    return above


def unsettled_by_probe(
    logits: Logits, own_logit: Tensor, own: Tensor, k: int, block_bytes: int, itemsize: int, probe: Tensor
) -> Tensor:
    """Step 1: the positions [o] of the rows (of own_logit's [r]) with fewer than k of the `probe` [p] columns above
    their own entry, in order; the others are settled at k. Row chunks keep a block within `block_bytes`."""
    r = int(own_logit.shape[0])
    per = itemsize + 2  # bytes per entry of a block: the logit, the "above" and "own column" masks
    probe = probe.to(own.device)
    step = max(1, block_bytes // (per * len(probe)))
    rows = torch.arange(r)
    left = [rows[:0]]
    for start in range(0, r, step):
        check_stop(what="OV self-copy shares")
        chunk = rows[start : start + step]
        count = _counted(logits(chunk, probe), own_logit[chunk], own[chunk, None] == probe[None, :])
        left.append(chunk[count < k])
    return torch.cat(left)


@dataclass
class Scanned:
    """What scan counted: per row asked, the columns above its own entry (capped at k); and the rows still open when
    scan handed them off (their counts so far, over the columns before `reached`)."""

    above: Tensor  # [o] int64
    open: Tensor  # [o'] positions into the rows asked, still open when handed off (empty when scanned to the end)
    reached: int  # the first column not yet counted for the open rows (n when none is open)


def scan(
    logits: Logits,
    own_logit: Tensor,
    own: Tensor,
    rows: Tensor,
    n: int,
    k: int,
    block_bytes: int,
    itemsize: int = 4,
    first_block: int = FIRST_BLOCK,
    begin: Tensor | None = None,
    count: Tensor | None = None,
    handoff: Callable[[int], bool] | None = None,
) -> Scanned:
    """Step 2 for the rows at positions `rows` [o]: the columns of all n above their own entry, capped at k, in
    blocks growing from first_block (within block_bytes), a row dropped from the next block once its count reaches
    k. A row may start at its column `begin` [o] with `count` [o] columns already counted before it (another scan
    handed it off). With `handoff`, the scan stops before a block once handoff(rows still open) is true and hands
    those rows back (Scanned.open, their counts, the column reached) for another scan to finish."""
    per = itemsize + 2  # bytes per entry of a block: the logit, the "above" and "left out" masks
    counted = torch.zeros(len(rows), dtype=torch.int64) if count is None else count.clone()
    live = torch.arange(len(rows))  # positions into rows still counting
    start = 0 if begin is None or not len(begin) else int(begin.min())
    width = first_block
    while len(live) and start < n:
        check_stop(what="OV self-copy shares")
        give_way()  # a background job's helper pauses here while a request wants its core
        if handoff is not None and handoff(len(live)):
            return Scanned(counted.clamp_max(k), live, start)
        c = max(1, min(width, n - start, block_bytes // max(1, per * len(live))))
        meets = live if begin is None else live[begin[live] < start + c]  # rows whose columns start by this block
        if len(meets):
            at = rows[meets]
            columns = torch.arange(start, start + c, device=own.device)
            left_out = own[at, None] == columns[None, :]  # [a, c] the row's own column
            if begin is not None:  # and the columns another scan counted for it
                left_out |= columns[None, :] < begin[meets, None].to(own.device)
            counted[meets] += _counted(logits(at, slice(start, start + c)), own_logit[at], left_out)
        live = live[counted[live] < k]
        start, width = start + c, 2 * width
    return Scanned(counted.clamp_max(k), live[:0], n)


def _counted(block: Tensor, own_logit: Tensor, mine: Tensor) -> Tensor:
    """[a] entries of block [a, c] above own_logit [a], the row's own column (mine [a, c] True) left out."""
    above = block > own_logit[:, None].to(block.dtype)
    return above.logical_and_(~mine.to(above.device)).sum(1).cpu()


def probe_size(n: int) -> int:
    """Columns probed in step 1 on n columns (0: no probe)."""
    return PROBE if n > PROBE else 0
