"""Mixture-of-experts GGUF files: Mixtral ("llama" with `llama.expert_count`), Qwen3-MoE ("qwen3moe") and OLMoE
("olmoe"), as llama.cpp's converter writes them (every layer's experts merged into one tensor per matrix):

    {arch}.expert_count, {arch}.expert_used_count          -> num_experts, experts_per_token
    {arch}.expert_feed_forward_length (else feed_forward_length) -> d_mlp, one expert's width
    blk.l.ffn_gate_inp.weight   [n_experts, d_model]              -> mlp.W_router [d_model, n_experts]
    blk.l.ffn_gate_exps.weight  [n_experts, d_mlp, d_model]       -> mlp.W_gate [n_experts, d_model, d_mlp]
    blk.l.ffn_up_exps.weight    [n_experts, d_mlp, d_model]       -> mlp.W_in   [n_experts, d_model, d_mlp]
    blk.l.ffn_down_exps.weight  [n_experts, d_model, d_mlp]       -> mlp.W_out  [n_experts, d_mlp, d_model]
(shapes in numpy's order, ggml's dims reversed). Each expert is a SwiGLU MLP and the router a softmax over the
experts (moe.py). How the chosen weights are normalised is not in the file: llama.cpp fixes it per architecture
(the norm_w argument of its build_moe_ffn), and so does `Architecture.norm_topk` (gguf.py): the top-k renormalised
for llama (Mixtral) and qwen3moe (every released Qwen3-MoE sets norm_topk_prob), the k largest softmax entries
as they are for olmoe (OLMoE's norm_topk_prob=false). Refused by name: another gating function than the softmax,
shared experts (their tensors are left unread, so the file is refused as having unexpected tensors), and
per-expert tensors of the files written before llama.cpp merged them.
"""

from __future__ import annotations

from typing import Any

from circuits_core.errors import CheckpointError
from circuits_core.formats.gguf_tensors import Metadata, Tensors

State = dict[str, Any]
SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX in {arch}.expert_gating_func


def expert_fields(meta: Metadata, arch: str, norm_topk: bool | None) -> dict[str, Any]:
    """The ModelConfig fields of a file's experts ({} for a dense model). `norm_topk`: the architecture's routing
    normalisation (None: llama.cpp runs no experts for it, so a file that has them is refused)."""
    n_experts = meta.int(f"{arch}.expert_count", 0)
    if not n_experts:
        return {}
    if norm_topk is None:
        raise CheckpointError(f"{meta.name}: mixture-of-experts {arch} files ({arch}.expert_count) are not supported")
    gating = meta.get(f"{arch}.expert_gating_func", SOFTMAX_GATING)
    if gating != SOFTMAX_GATING:
        raise CheckpointError(
            f"{meta.name}: {arch}.expert_gating_func={gating!r} is not supported (only the softmax router, 1)"
        )
    used = meta.int(f"{arch}.expert_used_count")
    if not 1 <= used <= n_experts:
        raise CheckpointError(f"{meta.name}: {arch}.expert_used_count={used} must be between 1 and {n_experts}")
    width = f"{arch}.expert_feed_forward_length"
    d_mlp = meta.int(width) if meta.header.has(width) else meta.int(f"{arch}.feed_forward_length")
    return {"num_experts": n_experts, "experts_per_token": used, "moe_norm_topk": norm_topk, "d_mlp": d_mlp}


def take_experts(tensors: Tensors, b: str, p: str, n_experts: int, d: int, d_mlp: int, sd: State) -> None:
    """Layer `b`'s router and experts (blk.l) into the state dict under `p` (blocks.l), each transposed to x @ W
    form as it is dequantised."""
    if f"{b}.ffn_gate_inp.weight" not in tensors.raw and f"{b}.ffn_gate.0.weight" in tensors.raw:
        raise CheckpointError(
            f"{tensors.name}: per-expert tensors ({b}.ffn_gate.0.weight, ...): files from before llama.cpp merged "
            f"the experts are not supported; convert the model again"
        )
    E, m = n_experts, d_mlp
    sd[f"{p}.mlp.W_router"] = tensors.need_transposed(f"{b}.ffn_gate_inp.weight", (E, d))  # [d_model, E]
    sd[f"{p}.mlp.W_gate"] = tensors.need_transposed(f"{b}.ffn_gate_exps.weight", (E, m, d))  # [E, d_model, d_mlp]
    sd[f"{p}.mlp.W_in"] = tensors.need_transposed(f"{b}.ffn_up_exps.weight", (E, m, d))  # [E, d_model, d_mlp]
    sd[f"{p}.mlp.W_out"] = tensors.need_transposed(f"{b}.ffn_down_exps.weight", (E, d, m))  # [E, d_mlp, d_model]
