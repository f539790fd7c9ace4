"""FLOPs of the forward pass, as Attention and MLP compute it (matrix products, 2 per multiply-add, as
torch.utils.flop_counter counts them): the one count every price of a forward pass, whole or stopped early, adds up
(prompt/frozen.py forward_cost, prompt/ablation.py, circuits/rotary.py kernel_cost)."""

from __future__ import annotations

from circuits_core.model.config import ModelConfig


def layer_flops(cfg: ModelConfig, rows: int, n: int, pattern: bool, mlp: bool) -> int:
    """FLOPs of one layer on `rows` sequences of n tokens (matrix products, 2 per multiply-add), as Attention and MLP
    compute them: the v projection, the q and k projections and the scores when the pattern is computed (`pattern`),
    z = A v, the output W_O, and the MLP when it is computed (`mlp`)."""
    tok = rows * n
    H, G, dh, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model
    qk = 2 * tok * d * dh * (H + G) + 2 * rows * H * n * n * dh if pattern else 0
    flops = qk + 2 * tok * d * dh * G + 2 * tok * H * dh * d + 2 * rows * H * n * n * dh
    if mlp and not cfg.attn_only:
        flops += 2 * tok * d * (cfg.d_mlp or 4 * d) * (3 if cfg.gated_mlp else 2)
    return flops


def unembed_flops(cfg: ModelConfig, rows: int, n: int) -> int:
    return 2 * rows * n * cfg.d_model * cfg.d_vocab
