"""The MLP layer: act(x W_in + b_in) W_out + b_out, or gated (SwiGLU and the gelu variants), row vectors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from circuits_core.config import ModelConfig
from circuits_core.errors import InvalidInputError
from circuits_core.hooks import Recorder


def activation(name: str | None, x: Tensor) -> Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "gelu":
        return F.gelu(x)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu(x)
    raise InvalidInputError(f"unknown act_fn {name!r}")


class MLP(nn.Module):
    """act(x W_in + b_in) W_out + b_out, or gated (TransformerLens GatedMLP, SwiGLU when act_fn is silu):
    (act(x W_gate) * (x W_in) + b_in) W_out + b_out (hook_pre = x W_gate, hook_pre_linear = x W_in)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        assert cfg.d_mlp is not None
        self.cfg, self.layer = cfg, layer
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        if cfg.gated_mlp:
            self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        if cfg.use_bias:
            self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
            self.b_out = nn.Parameter(torch.zeros(cfg.d_model))

    def forward(self, x: Tensor, rec: Recorder) -> Tensor:
        # x: [batch, pos, d_model] -> [batch, pos, d_model]
        p = f"blocks.{self.layer}.mlp"
        b_in = self.b_in if self.cfg.use_bias else 0
        if self.cfg.gated_mlp:
            gate = activation(self.cfg.act_fn, rec(f"{p}.hook_pre", x @ self.W_gate))  # [batch, pos, d_mlp]
            post = rec(f"{p}.hook_post", gate * rec(f"{p}.hook_pre_linear", x @ self.W_in) + b_in)
        else:
            post = rec(f"{p}.hook_post", activation(self.cfg.act_fn, rec(f"{p}.hook_pre", x @ self.W_in + b_in)))
        return post @ self.W_out + (self.b_out if self.cfg.use_bias else 0)
