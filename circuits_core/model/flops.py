"""FLOPs of the forward pass, as Attention and MLP compute it (matrix products, 2 per multiply-add, as
torch.utils.flop_counter counts them): the one count every price of a forward pass, whole or stopped early, adds up
(prompt/frozen.py forward_cost, prompt/ablation.py, circuits/rotary.py kernel_cost)."""

from __future__ import annotations

from collections.abc import Iterable

from circuits_core.model.config import ModelConfig


def layers_flops(cfg: ModelConfig, rows: int, n: int, pattern: bool, mlp: bool, layers: Iterable[int]) -> int:
    """layer_flops summed over `layers` (their MLPs may differ: DeepSeek's first layers are dense)."""
    return sum(layer_flops(cfg, rows, n, pattern, mlp, layer) for layer in layers)


def layer_flops(cfg: ModelConfig, rows: int, n: int, pattern: bool, mlp: bool, layer: int) -> int:
    """FLOPs of layer `layer` on `rows` sequences of n tokens (matrix products, 2 per multiply-add), as Attention and
    MLP compute them: the v projection, the q and k projections and the scores when the pattern is computed
    (`pattern`), z = A v, the output W_O, and the MLP when it is computed (`mlp`: mlp_flops)."""
    tok = rows * n
    H, G, dh, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model
    if cfg.latent_attention:
        q_proj, k_proj, v_proj = latent_projection_flops(cfg, tok)
    else:
        q_proj, k_proj, v_proj = 2 * tok * d * dh * H, 2 * tok * d * dh * G, 2 * tok * d * dh * G
    qk = q_proj + k_proj + 2 * rows * H * n * n * dh if pattern else 0
    flops = qk + v_proj + 2 * tok * H * dh * d + 2 * rows * H * n * n * dh
    return flops + (mlp_flops(cfg, layer, tok) if mlp else 0)


def mlp_flops(cfg: ModelConfig, layer: int, tok: int) -> int:
    """FLOPs of layer `layer`'s MLP on `tok` tokens: a dense MLP's two (three when gated) products of its width; a
    mixture of experts' router logits, then each token's experts_per_token experts (three products of d_mlp each:
    moe.MoE sends every token to k distinct experts) and the shared experts' three products, always on."""
    if cfg.attn_only:
        return 0
    d = cfg.d_model
    if not cfg.layer_has_experts(layer):
        return 2 * tok * d * (cfg.layer_d_mlp(layer) or 4 * d) * (3 if cfg.gated_mlp else 2)
    E, k, m = cfg.num_experts or 0, cfg.experts_per_token, cfg.d_mlp or 0
    shared = 3 * 2 * tok * d * cfg.moe_shared_d_mlp if cfg.moe_shared_d_mlp is not None else 0
    return 2 * tok * d * E + 3 * 2 * tok * k * d * m + shared


def unembed_flops(cfg: ModelConfig, rows: int, n: int) -> int:
    return 2 * rows * n * cfg.d_model * cfg.d_vocab


def latent_projection_flops(cfg: ModelConfig, tok: int) -> tuple[int, int, int]:
    """(queries, keys, values) projection FLOPs of multi-head latent attention on `tok` tokens (latent_attention.py):
    the query latent and its per-head up-projections (or the up-projections straight from the stream), the key/value
    latent with the shared rotary key and the content keys' up-projection, and the values' (the latent computed again:
    keys and values may read different streams)."""
    H, d, r_q, r_kv = cfg.n_heads, cfg.d_model, cfg.mla_q_rank, cfg.mla_kv_rank or 0
    d_rope, d_nope, d_v = cfg.rotary_dim or 0, cfg.mla_d_nope, cfg.mla_d_v
    q_in = r_q if r_q is not None else d
    queries = (2 * tok * d * r_q if r_q is not None else 0) + 2 * tok * q_in * H * (d_nope + d_rope)
    keys = 2 * tok * d * (r_kv + d_rope) + 2 * tok * r_kv * H * d_nope
    values = 2 * tok * d * r_kv + 2 * tok * r_kv * H * d_v
    return queries, keys, values
