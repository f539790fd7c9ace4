"""The recipes of the shipped toy models: what determines a training run, and the seeded model it starts from.

Paper context (Elhage et al. 2021): the toy models are attention-only, without biases or normalisation, with
positions only in the query and key inputs ("shortformer"), so the residual stream carries tokens alone. A `Recipe`
fixes the shape, the optimiser's settings, the batch rows and the seed; `make_model` gives its initial weights
(circuits_core.model.transformer.init_weights, a sinusoidal position table, or another toy's embeddings and heads
for a toy trained on after it). train.py runs a recipe; RECIPES are the ones `make models` trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import torch
from torch import Tensor

from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, init_weights


@dataclass(frozen=True)
class Recipe:
    """Everything that determines a training run (besides the corpus and the device)."""

    n_layers: int
    steps: int
    d_model: int = 128
    n_heads: int = 8
    d_head: int = 16
    n_ctx: int = 128
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    beta2: float = 0.98
    grad_clip: float = 1.0
    repeat_frac: float = 0.0  # fraction of rows that are BOS + r + r + ... (r random frequent tokens)
    repeat_min: int = 8
    repeat_max: int = 63
    pos_init: str = "sin"  # sinusoidal table (learnable) or "normal" (std_embed)
    # "bloom" or "mpt": ALiBi slopes (circuits_core.model.alibi) instead of a learned positional table
    alibi: str | None = None
    # A toy trained before (its folder name beside this one's) whose W_E and W_U this model starts from, and with
    # init_heads its heads too: head h of layer l starts as that toy's head init_heads[l][h] (its positions, if any,
    # are left behind)
    init_from: str | None = None
    init_heads: tuple[tuple[int, ...], ...] | None = None
    std_embed: float = 0.02
    seed: int = 0
    eval_every: int = 250

    def model_config(self, d_vocab: int, bos: int) -> ModelConfig:
        return ModelConfig(
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_head=self.d_head,
            d_vocab=d_vocab,
            n_ctx=self.n_ctx,
            attn_only=True,
            normalization_type=None,
            use_bias=False,
            bos_token_id=bos,
            # Positions only enter attention, so a model without layers has none; ALiBi has no table either.
            positional_embedding_type="shortformer" if self.n_layers and self.alibi is None else "none",
            alibi=cast("Literal['bloom', 'mpt'] | None", self.alibi),
        )


RECIPES: dict[str, Recipe] = {
    "toy-0l": Recipe(n_layers=0, steps=1500, batch=32, eval_every=250),
    "toy-1l": Recipe(n_layers=1, steps=1500, batch=8, eval_every=100),
    # 25 % of the rows are BOS + r + r + ... (random frequent tokens): text alone gave induction 0.33 in 60k steps.
    "toy-2l": Recipe(n_layers=2, steps=11500, batch=8, repeat_frac=0.25, eval_every=250),
    # toy-2l's weights under ALiBi (BLOOM's slopes): its previous-token head L0H5 moves to the steepest slope (head 0,
    # m = 1/2), its induction head L1H2 to the flattest (head 7, m = 1/256); trained on after it (`all` trains it
    # first).
    "toy-alibi-2l": Recipe(
        n_layers=2,
        steps=1600,
        batch=4,
        lr=3e-3,
        repeat_frac=0.5,
        alibi="bloom",
        init_from="toy-2l",
        init_heads=((5, 1, 2, 3, 4, 0, 6, 7), (0, 1, 7, 3, 4, 5, 6, 2)),
        eval_every=200,
    ),
}


def sin_positions(n_ctx: int, d_model: int) -> Tensor:
    """[n_ctx, d_model] sinusoidal table (Vaswani et al.): sin on even, cos on odd dimensions."""
    pos = torch.arange(n_ctx, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_ctx, d_model, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table


def make_model(recipe: Recipe, d_vocab: int, bos: int, out: Path | None = None) -> Transformer:
    """The seeded initial model; with recipe.init_from, W_E and W_U (and the heads) are those of that toy in `out`."""
    model = init_weights(Transformer(recipe.model_config(d_vocab, bos)), seed=recipe.seed, std_embed=recipe.std_embed)
    with torch.no_grad():
        if recipe.pos_init == "sin" and model.W_pos is not None:
            model.W_pos.copy_(sin_positions(recipe.n_ctx, recipe.d_model).float())
        if recipe.init_from is not None:
            source = load_checkpoint(Path(out or ".") / recipe.init_from, process=False).model
            if (source.cfg.d_vocab, source.cfg.d_model) != (d_vocab, recipe.d_model):
                raise ValueError(f"{recipe.init_from} has another vocabulary or width than the recipe")
            model.W_E.copy_(source.W_E.float())
            model.W_U.copy_(source.W_U.float())
            for layer, order in enumerate(recipe.init_heads or ()):
                mine, theirs = model.blocks[layer].attn, source.blocks[layer].attn
                for name in ("W_Q", "W_K", "W_V", "W_O"):
                    getattr(mine, name).copy_(getattr(theirs, name)[list(order)].float())
    return model
