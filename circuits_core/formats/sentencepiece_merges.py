"""The merges of a SentencePiece BPE vocabulary that lists none (a GGUF's Gemma vocabulary).

Every split of an entry into two entries is a merge, ranked by the entry's place in the vocabulary (SentencePiece keeps
its pieces best-first), then longer left piece first; this is how transformers rebuilds the same tokenizer from the
same file. Gemma 3's 262,144 entries have 1.2 million cuts and make 514,906 merges: a loop over the cuts in Python
(two slices and up to two dict lookups each, `merges_by_loop`) takes about 1.7 CPU-seconds holding the GIL. Here a cut
is a few numbers in arrays instead:
- the entries' code points, `codes [W, V]` (W the longest entry, zero past each entry's end), with the entries in
  order of decreasing length, so that those longer than c characters are the first n_c columns;
- a polynomial hash mod 2^64 of each prefix, h(e[:c+1]) = h(e[:c])·B + code + 1, a column at a time, and from it each
  suffix's: h(e[c:]) = h(e) - h(e[:c])·B^(len(e) - c);
- a cut is a candidate when both halves' hashes are entries' hashes (the vocabulary's hashes sorted and bucketed by
  their top bits, `SortedHashes`), and a merge when both entries found have the halves' lengths and code points (a
  piece outside the vocabulary whose hash equals an entry's is dropped there). Two entries with the same hash would
  hide one of them, so the loop is used then (for Gemma's vocabulary the chance is about 2^-29), and for entries over
  MAX_HASHED_CHARS characters (the code-point array grows with the longest entry). The result is exact either way.
"""

from __future__ import annotations

import numpy as np

BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so that B^k never vanishes mod 2^64
MAX_HASHED_CHARS = 64  # codes [W, V] takes 4·W·V bytes: 64 MiB for Gemma's 262,144 entries at W = 64
BUCKETS_PER_ENTRY = 4
SPREAD = np.uint64(
    0xBF58476D1CE4E5B9
)  # odd: h -> h·SPREAD is one-to-one mod 2^64 and spreads small h over the top bits


def merges_by_loop(spelled: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of an entry into two entries, by the entry's place in the vocabulary, longer left piece first."""
    merges = []
    for entry in spelled:
        for cut in range(len(entry) - 1, 0, -1):
            left = entry[:cut]
            if left in vocab:
                right = entry[cut:]
                if right in vocab:
                    merges.append((left, right))
    return merges


class SortedHashes:
    """Hashes sorted, with the start of each bucket of equal top bits: `find` looks a query up in its own bucket (about
    1 / BUCKETS_PER_ENTRY entries) rather than by a binary search over all of them. The hashes are kept times SPREAD
    (one-to-one), so that short entries' small hashes (code + 1 for one character) do not share the first bucket."""

    def __init__(self, hashes: np.ndarray):
        with np.errstate(over="ignore"):
            spread = hashes * SPREAD
        self.order = np.argsort(spread)
        self.sorted = spread[self.order]
        bits = max(1, int(np.ceil(np.log2(max(2, BUCKETS_PER_ENTRY * len(hashes))))))
        self.shift = np.uint64(64 - bits)
        counts = np.bincount((self.sorted >> self.shift).astype(np.intp), minlength=2**bits)
        self.starts = np.concatenate(
            [[0], np.cumsum(counts)]
        )  # [2^bits + 1]: bucket b is sorted[starts[b]:starts[b+1]]
        self.unique = bool(np.all(self.sorted[1:] != self.sorted[:-1]))

    def find(self, queries: np.ndarray) -> np.ndarray:
        """For each query the index (into the hashes given) of an equal hash, -1 where there is none."""
        with np.errstate(over="ignore"):
            queries = queries * SPREAD
        bucket = queries >> self.shift
        at, end = self.starts[bucket], self.starts[bucket + 1]
        found = np.full(len(queries), -1, dtype=np.int64)
        live = np.flatnonzero(at < end)
        while live.size:  # one entry of every live bucket per round; a bucket holds a few at most
            here = at[live]
            hit = self.sorted[here] == queries[live]
            found[live[hit]] = self.order[here[hit]]
            at[live] = here + 1
            live = live[~hit & (here + 1 < end[live])]
        return found


def sentencepiece_merges(spelled: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges of `merges_by_loop`, in the same order, found through hashes of the cuts (the module's docstring).
    `vocab` maps each entry of `spelled` (all distinct) to its place."""
    lengths = np.fromiter(map(len, spelled), dtype=np.int64, count=len(spelled))
    width = int(lengths.max(initial=0))
    if width < 2 or width > MAX_HASHED_CHARS:
        return merges_by_loop(spelled, vocab)
    by_length = np.argsort(-lengths, kind="stable")  # [V] entry ids, longest first
    length = lengths[by_length]
    longer = np.searchsorted(-length, -np.arange(width + 1), side="left")  # longer[c]: entries over c characters
    flat = np.frombuffer("".join(spelled).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)  # every code point
    start = (np.cumsum(lengths) - lengths)[by_length]  # [V] where each entry's code points start in `flat`
    codes = np.zeros((width, len(spelled)), dtype=np.uint32)  # [W, V] code points, zero past each entry's end
    for c in range(width):
        codes[c, : longer[c]] = flat[start[: longer[c]] + c]
    powers = np.ones(width + 1, dtype=np.uint64)
    prefix = np.zeros(len(spelled), dtype=np.uint64)  # h(e[:c]) of the entries longer than c - 1
    whole = np.zeros(len(spelled), dtype=np.uint64)  # h(e)
    with np.errstate(over="ignore"):
        for c in range(width):
            powers[c + 1] = powers[c] * BASE
            n = longer[c]
            prefix[:n] = prefix[:n] * BASE + codes[c, :n] + np.uint64(1)
            whole[longer[c + 1] : n] = prefix[longer[c + 1] : n]  # the entries of exactly c + 1 characters
    entries = SortedHashes(whole)
    if not entries.unique:
        return merges_by_loop(spelled, vocab)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []  # (entry, left, right) by-length indices, cut
    prefix[:] = 0
    with np.errstate(over="ignore"):
        for c in range(1, width):
            n = longer[c]
            prefix[:n] = prefix[:n] * BASE + codes[c - 1, :n] + np.uint64(1)  # h(e[:c]) of the entries longer than c
            left = entries.find(prefix[:n])
            rows = np.flatnonzero(left >= 0)
            right = entries.find(whole[rows] - prefix[rows] * powers[length[rows] - c])
            keep = right >= 0
            rows, left, right = rows[keep], left[rows[keep]], right[keep]
            keep = (length[left] == c) & (length[right] == length[rows] - c)
            rows, left, right = rows[keep], left[keep], right[keep]
            same = _halves_equal(codes, length, rows, left, right, c)
            found.append((rows[same], left[same], right[same], c))
    entry = by_length[np.concatenate([f[0] for f in found])]
    cut = np.concatenate([np.full(len(f[0]), f[3]) for f in found])
    rank = np.argsort(entry * (width + 1) + (width - cut))  # by the entry's place, then longer left piece first
    lefts = by_length[np.concatenate([f[1] for f in found])][rank].tolist()
    rights = by_length[np.concatenate([f[2] for f in found])][rank].tolist()
    return [(spelled[a], spelled[b]) for a, b in zip(lefts, rights, strict=True)]


def _halves_equal(
    codes: np.ndarray, length: np.ndarray, rows: np.ndarray, left: np.ndarray, right: np.ndarray, c: int
) -> np.ndarray:
    """Whether entry rows[i]'s first c code points are entry left[i]'s and its others entry right[i]'s, all three
    by-length indices (rows ascending: longest first) with lengths c, length - c already checked. Compared over bands
    of lengths up to 2, 4, 8, ... characters, so that a short entry is not compared over the longest one's width."""
    width = codes.shape[0]
    tops = sorted({min(width, 2**k) for k in range(1, width.bit_length() + 1)} - set(range(c + 1)), reverse=True)
    starts = np.searchsorted(-length[rows], -np.array(tops), side="left")  # first row of each band: length <= top
    same = np.zeros(len(rows), dtype=bool)
    for top, start, end in zip(tops, starts, [*starts[1:], len(rows)], strict=True):
        r, a, b = rows[start:end], left[start:end], right[start:end]
        same[start:end] = (codes[:c, r] == codes[:c, a]).all(0) & (codes[c:top, r] == codes[: top - c, b]).all(0)
    return same
