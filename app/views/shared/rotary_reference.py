"""What the rotary views share with the QK, composition and heads views: whether a model has rotary positions,
the checked query-key offset δ of a request, and μ_l, the mean ln1 output entering each layer on a reference text
(circuits_core/circuits/rotary.py REFERENCE_TEXT, tokenised with the model's tokenizer; seeded random token ids
for a model without one). μ is derived data of the checkpoint: it is computed once per answer digest and kept in
the result cache (and the store behind it) under ("rotary-reference", digest), so every head's kernel and the
heads table reuse it."""

from __future__ import annotations

import torch

from app.scheduling import cached_build, is_cached
from app.schemas.rotary import ReferenceMeans, ReferenceText
from circuits_core.circuits import rotary
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.window import check_attended

RANDOM_REFERENCE_TOKENS = 256  # length of the seeded random reference for a model without a tokenizer


# -- the reference text and μ ------------------------------------------------------------------------------
def reference_tokens(loaded: LoadedModel) -> tuple[torch.Tensor, ReferenceText]:
    """[1, n] token ids of the reference text (at most n_ctx), and its description."""
    cfg, tok = loaded.model.cfg, loaded.tokenizer
    if tok is not None:
        ids = tok.encode(rotary.REFERENCE_TEXT)[: cfg.n_ctx]
        return torch.tensor([ids]), ReferenceText(name=rotary.REFERENCE_NAME, n_tokens=len(ids), tokenized=True)
    n = min(RANDOM_REFERENCE_TOKENS, cfg.n_ctx)
    gen = torch.Generator().manual_seed(0)
    ids_t = torch.randint(0, cfg.d_vocab, (1, n), generator=gen)
    name = f"{n} token ids drawn uniformly from the vocabulary (seed 0): the model has no tokenizer"
    return ids_t, ReferenceText(name=name, n_tokens=n, tokenized=False)


def _measure(loaded: LoadedModel) -> ReferenceMeans:
    tokens, ref = reference_tokens(loaded)
    means = rotary.reference_means(loaded.model, tokens.to(loaded.model.device))
    return ReferenceMeans(reference=ref, means=means.tolist())


def reference_means(loaded: LoadedModel) -> tuple[torch.Tensor, ReferenceText]:
    """μ [n_layers, d_model] float64 and the text it was measured on (cached per checkpoint digest); rotary and ALiBi
    models."""
    if loaded.model.cfg.alibi is None:
        rotary.check_rotary(loaded.model)
    stored = cached_build(("rotary-reference", str(loaded.digest)), ReferenceMeans, lambda: _measure(loaded))
    return torch.tensor(stored.means, dtype=torch.float64, device=loaded.model.device), stored.reference


def reference_tokens_bound(loaded: LoadedModel) -> int:
    """The tokens μ is measured on (reference_tokens: the reference text tokenised, no tensor work), for its price."""
    return reference_tokens(loaded)[1].n_tokens


def reference_forward_tokens(loaded: LoadedModel) -> int:
    """The tokens of the forward pass μ still needs: none once it is in the result cache, else the reference's."""
    return 0 if is_cached(("rotary-reference", str(loaded.digest))) else reference_tokens_bound(loaded)


def is_rotary(loaded: LoadedModel) -> bool:
    return loaded.model.cfg.positional_embedding_type == "rotary"


def rotary_offset(loaded: LoadedModel, kind: str, offset: int) -> int | None:
    """The offset of a Q/K composition of a rotary model (checked); None for V or a model without rotary positions,
    where only 0 is accepted."""
    if kind == "v" and offset:
        raise InvalidInputError("V-composition does not depend on the offset (values are not rotated); use offset=0")
    check_offset(loaded, offset)
    return offset if is_rotary(loaded) and kind in ("q", "k") else None


def check_offset(loaded: LoadedModel, offset: int, layer: int | None = None) -> None:
    """An offset other than 0 needs rotary positions; it must be below n_ctx, and below the window of a sliding
    `layer` (the only offsets that layer attends)."""
    if offset != 0 and loaded.model.cfg.positional_embedding_type != "rotary":
        raise InvalidInputError(
            f"offset applies to rotary models only; this one has {loaded.model.cfg.positional_embedding_type!r} "
            f"positions"
        )
    if offset:
        rotary.check_offsets(loaded.model, [offset])
    if layer is not None:
        check_attended(loaded.model.cfg, layer, offset)
