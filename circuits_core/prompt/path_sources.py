"""Where the paths of a frozen-attention expansion start (paths.py, docs/maths.md §2.10): the embedding, each
attention layer's constant output, each MLP's output in the clean run (an MLP is a node: its inputs are not
expanded further), or with a mixture of experts each expert's weighted output under the frozen routing; each with
the first layer that reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.model.transformer import Transformer
from circuits_core.prompt.frozen import FrozenRun, embed_source, written_bias


@dataclass
class PathSource:
    name: tuple[str, ...]  # () for the embedding
    entry: int  # first layer that reads it
    X: Tensor  # [n, d_model], or [1, d_model] for a constant (bias) source


def path_sources(model: Transformer, run: FrozenRun) -> list[PathSource]:
    """The embedding, each attention layer's bias and each MLP's output (or each expert's that a token used), with
    the layer where they enter."""
    out = [PathSource((), 0, embed_source(model, run))]
    for layer in range(model.cfg.n_layers):
        out.append(PathSource((f"bias:L{layer}",), layer + 1, written_bias(model, run, layer)))
        if not model.cfg.attn_only:
            out += [PathSource((name,), layer + 1, X) for name, X in mlp_parts(model, run, layer)]
    return out


def mlp_parts(model: Transformer, run: FrozenRun, layer: int) -> list[tuple[str, Tensor]]:
    """("mlp:L3", its output [n, d_model]); for a mixture of experts, with the routing frozen, one part per expert
    that some token used: ("mlp:L3.e5", weight x expert 5's output on the tokens routed to it, zero elsewhere).
    The parts sum to the MLP's output."""
    if not model.cfg.layer_has_experts(layer):  # (DeepSeek's first layers are dense)
        return [(f"mlp:L{layer}", run.cache[f"blocks.{layer}.hook_mlp_out"])]
    p = f"blocks.{layer}.mlp"
    indices, slots = run.cache[f"{p}.hook_expert_indices"], run.cache[f"{p}.hook_expert_out"]  # [n, k], [n, k, d]
    shared = [(f"mlp:L{layer}.shared", run.cache[f"{p}.hook_shared_out"])] if model.cfg.moe_shared_d_mlp else []
    return [
        (f"mlp:L{layer}.e{e}", (slots * (indices == e)[..., None].to(slots.dtype)).sum(1))
        for e in torch.unique(indices).tolist()
    ] + shared
