"""The MLP layer: act(x W_in + b_in) W_out + b_out, or gated (SwiGLU and the gelu variants), row vectors."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from circuits_core.model.config import ModelConfig
from circuits_core.model.hooks import Recorder
from circuits_core.model.linear import activation, affine


class MLP(nn.Module):
    """act(x W_in + b_in) W_out + b_out, or gated (TransformerLens GatedMLP, SwiGLU when act_fn is silu):
    (act(x W_gate) * (x W_in) + b_in) W_out + b_out (hook_pre = x W_gate, hook_pre_linear = x W_in).

    Unless hook_pre is recorded (or stopped at), act is applied by the product itself (linear.affine): in float32 a
    run that records hook_pre can differ from one that does not by rounding (~1e-6 of the logits' scale)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        m = cfg.layer_d_mlp(layer)  # d_mlp (DeepSeek's dense layers among experts: d_mlp_dense)
        assert m is not None
        self.cfg, self.layer = cfg, layer
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, m))
        if cfg.gated_mlp:
            self.W_gate = nn.Parameter(torch.empty(cfg.d_model, m))
        self.W_out = nn.Parameter(torch.empty(m, cfg.d_model))
        if cfg.use_bias:
            self.b_in = nn.Parameter(torch.zeros(m))
            self.b_out = nn.Parameter(torch.zeros(cfg.d_model))

    def __getattr__(self, name: str) -> Any:
        # A deferred weight (a meta placeholder: formats/lazy_mlp.py) is read when first used: `loader` fills in
        # every weight of this layer. nn.Module keeps parameters in a dict, so every weight read comes here.
        value = super().__getattr__(name)
        if isinstance(value, Tensor) and value.is_meta and self.__dict__.get("loader") is not None:
            self.__dict__["loader"](self)
            value = super().__getattr__(name)
        return value

    @property
    def deferred(self) -> bool:
        """Whether this layer's weights are still unread placeholders (see __getattr__)."""
        return any(p.is_meta for p in self._parameters.values() if p is not None)

    def forward(self, x: Tensor, rec: Recorder) -> Tensor:
        # x: [batch, pos, d_model] -> [batch, pos, d_model]
        p = f"blocks.{self.layer}.mlp"
        b_in, b_out = (self.b_in, self.b_out) if self.cfg.use_bias else (None, None)
        if self.cfg.gated_mlp:
            gate = activation(self.cfg.act_fn, rec(f"{p}.hook_pre", affine(x, self.W_gate)))  # [batch, pos, d_mlp]
            linear = rec(f"{p}.hook_pre_linear", affine(x, self.W_in))
            post = rec(f"{p}.hook_post", gate * linear if b_in is None else torch.addcmul(b_in, gate, linear))
        else:
            if rec.wants(f"{p}.hook_pre"):  # [batch, pos, d_mlp]
                post = activation(self.cfg.act_fn, rec(f"{p}.hook_pre", affine(x, self.W_in, b_in)))
            else:  # the activation applied by the product itself (linear.py)
                post = affine(x, self.W_in, b_in, self.cfg.act_fn)
            rec(f"{p}.hook_post", post)
        return affine(post, self.W_out, b_out)
