"""The tokens a global circuit table ranks (rows and columns alike): min_count's frequent tokens, read from the
model folder's token_counts.npy (circuits_core.prompt.phenomena.load_token_counts); else every token of a vocabulary
up to DEFAULT_VOCAB; else its DEFAULT_VOCAB most frequent tokens, or its lowest ids. Shared by the circuit tables,
composition's token circuits and the heads' copying metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from app.params import DEFAULT_VOCAB
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.prompt.phenomena import TOKEN_COUNTS_FILE, load_token_counts


def frequent_tokens(loaded: LoadedModel, min_count: int | None) -> Tensor | None:
    """Sorted ids [n] of the tokens seen at least min_count times in training; None when min_count is None.

    InvalidInputError when the model has no token counts or no token is that frequent.
    """
    if min_count is None:
        return None
    counts = load_token_counts(loaded.path, loaded.model.cfg.d_vocab)
    if counts is None:
        raise InvalidInputError(
            f"model {loaded.path.name!r} has no token counts ({TOKEN_COUNTS_FILE} in its folder): min_count is not "
            f"available"
        )
    ids = np.flatnonzero(counts >= min_count)
    if ids.size == 0:
        raise InvalidInputError(
            f"no token was seen min_count={min_count} times in training (the most frequent: {int(counts.max())})"
        )
    return torch.from_numpy(ids).long()


def has_token_counts(loaded: LoadedModel) -> bool:
    """Whether the model folder carries token_counts.npy (so min_count is available)."""
    return (loaded.path / TOKEN_COUNTS_FILE).is_file()


@dataclass(frozen=True)
class TokenSet:
    """The tokens a global table ranks (rows and columns alike)."""

    ids: Tensor | None  # [n] sorted token ids; None: every token
    n: int
    said: str | None  # in words, for the page and the answer (None: every token)
    name: str  # in the shared table's cache key


def token_set(loaded: LoadedModel, min_count: int | None, vocab: Literal["default", "all"]) -> TokenSet:
    """min_count's frequent tokens when given; else every token of a vocabulary up to DEFAULT_VOCAB tokens (or with
    vocab="all"); else the DEFAULT_VOCAB most frequent tokens by token_counts.npy (ties: lower id first), or else the
    DEFAULT_VOCAB lowest ids."""
    d_vocab = loaded.model.cfg.d_vocab
    if min_count is not None:
        ids = frequent_tokens(loaded, min_count)
        assert ids is not None
        n = int(ids.numel())
        return TokenSet(
            ids, n, f"the {n:,} tokens seen at least {min_count:,} times in training", f"min_count={min_count}"
        )
    if vocab == "all" or d_vocab <= DEFAULT_VOCAB:
        return TokenSet(None, d_vocab, None, "all")
    counts = load_token_counts(loaded.path, d_vocab)
    if counts is not None:
        top = np.sort(np.argsort(-counts, kind="stable")[:DEFAULT_VOCAB])
        return TokenSet(
            torch.from_numpy(top).long(),
            DEFAULT_VOCAB,
            f"the {DEFAULT_VOCAB:,} most frequent of the {d_vocab:,} tokens (training counts)",
            "frequent",
        )
    return TokenSet(
        torch.arange(DEFAULT_VOCAB),
        DEFAULT_VOCAB,
        f"the {DEFAULT_VOCAB:,} lowest ids of the {d_vocab:,} tokens (the model has no training counts; in a BPE "
        "vocabulary the earliest merges, roughly the most frequent)",
        "lowest-ids",
    )
