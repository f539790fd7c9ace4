"""The transformer: one implementation, row-vector convention (`x @ W`), TransformerLens names and shapes.

Paper section: "Transformer Overview" (Elhage et al. 2021). Residual stream x_0 = W_E[t] (+ W_pos for
standard positions); each layer adds sum_h h(x) (+ an MLP); logits = x_L @ W_U (+ b_U).

Parameter names and shapes are TransformerLens's, so a TransformerLens state dict loads with
`load_state_dict(strict=True)`:
    embed.W_E [d_vocab, d_model]          pos_embed.W_pos [n_ctx, d_model]
    blocks.{l}.attn.W_Q/W_K/W_V [n_heads, d_model, d_head]   b_Q/b_K/b_V [n_heads, d_head]
    blocks.{l}.attn.W_O [n_heads, d_head, d_model]           b_O [d_model]
    blocks.{l}.ln1.w/b, ln2.w/b [d_model]  blocks.{l}.mlp.W_in [d_model, d_mlp], b_in, W_out, b_out
    ln_final.w/b [d_model]                unembed.W_U [d_model, d_vocab], b_U [d_vocab]

Positions: `standard` adds W_pos to the residual stream; `shortformer` (the paper's models) adds it to the
query and key inputs only, after ln1; `rotary` rotates q and k (GPT-NeoX layout, the first rotary_dim
dimensions); `none` has no positions.

`run()` returns logits and, on request, a cache of named activations with TransformerLens hook names.
Frozen runs (`Frozen`): attention patterns and LayerNorm scales (and, on request, MLP outputs) taken from a
previous run instead of being computed. With both frozen, the network is linear in its input embeddings (the paper's "freezing attention
patterns" trick) -- the path expansions stand on this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from circuits_core.config import ModelConfig
from circuits_core.errors import InvalidInputError

# A name filter: None keeps nothing, a callable or a set of names keeps those.
NameFilter = Callable[[str], bool] | Iterable[str] | None


@dataclass
class Frozen:
    """Values to use instead of computing them (keys are TransformerLens hook names).

    patterns:  {"blocks.{l}.attn.hook_pattern": Tensor[batch, n_heads, q_pos, k_pos]}
    ln_scales: {"blocks.{l}.ln1.hook_scale" | "blocks.{l}.ln2.hook_scale" | "ln_final.hook_scale":
                Tensor[batch, pos, 1]}
    value_resid: {layer: Tensor[batch, pos, d_model]}: residual stream that layer l's *values* read
                 (the term-importance rerun); queries and keys still read the current residual stream.
    mlp_out: {layer: Tensor[batch, pos, d_model]}: layer l's MLP output (`hook_mlp_out`), used instead of
             computing it (ln2 and the MLP are skipped, their hooks are not recorded): an MLP as a fixed node,
             as in paths.py.
    """

    patterns: dict[str, Tensor] = field(default_factory=dict)
    ln_scales: dict[str, Tensor] = field(default_factory=dict)
    value_resid: dict[int, Tensor] = field(default_factory=dict)
    mlp_out: dict[int, Tensor] = field(default_factory=dict)


class _StopRun(Exception):
    """Raised by the recorder right after it saw the `stop_after` hook (Transformer.run_until)."""


class _Recorder:
    def __init__(self, names: NameFilter, stop_after: str | None = None):
        self.cache: dict[str, Tensor] = {}
        self.stop_after = stop_after
        if names is None:
            self._keep: Callable[[str], bool] = lambda _name: False
        elif callable(names):
            self._keep = names
        else:
            wanted = set(names)
            self._keep = wanted.__contains__

    def wants(self, name: str) -> bool:
        return self._keep(name)

    def __call__(self, name: str, value: Tensor) -> Tensor:
        if self._keep(name):
            self.cache[name] = value
        if name == self.stop_after:
            raise _StopRun
        return value


class LayerNorm(nn.Module):
    """LayerNorm with TransformerLens's `hook_scale`; `LNPre` has no weight or bias (they were folded)."""

    def __init__(self, cfg: ModelConfig, name: str):
        super().__init__()
        self.cfg, self.name = cfg, name
        self.has_weights = cfg.normalization_type == "LN"
        if self.has_weights:
            self.w = nn.Parameter(torch.ones(cfg.d_model))
            self.b = nn.Parameter(torch.zeros(cfg.d_model))

    def forward(self, x: Tensor, rec: _Recorder, frozen: Frozen | None) -> Tensor:
        # x: [batch, pos, d_model]
        if self.cfg.normalization_type is None:
            return x
        key = f"{self.name}.hook_scale"
        computed = frozen is None or key not in frozen.ln_scales
        if computed and not rec.wants(key) and not rec.wants(f"{self.name}.hook_normalized"):
            # Nothing to record or replace: the same maths as below, as torch's fused kernel.
            w, b = (self.w, self.b) if self.has_weights else (None, None)
            return F.layer_norm(x, x.shape[-1:], w, b, self.cfg.eps)
        x = x - x.mean(-1, keepdim=True)
        if frozen is not None and key in frozen.ln_scales:
            scale = frozen.ln_scales[key]  # [batch, pos, 1]
        else:
            scale = (x.pow(2).mean(-1, keepdim=True) + self.cfg.eps).sqrt()
        rec(key, scale)
        x = x / scale
        if self.has_weights:
            x = x * self.w + self.b
        return rec(f"{self.name}.hook_normalized", x)


def rotary_tables(cfg: ModelConfig, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables [n, rotary_dim] in the GPT-NeoX (rotate-half) layout."""
    rd = cfg.rotary_dim or cfg.d_head
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, rd, 2, device=device, dtype=torch.float64) / rd))
    angles = torch.arange(n, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [n, rd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [n, rd]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first rotary_dim dims of x [batch, pos, n_heads, d_head] by position."""
    rd = cos.shape[-1]
    rot, keep = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos_b, sin_b = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([rot * cos_b + rotated * sin_b, keep], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, d, dh = cfg.n_heads, cfg.d_model, cfg.d_head
        self.W_Q = nn.Parameter(torch.empty(h, d, dh))
        self.W_K = nn.Parameter(torch.empty(h, d, dh))
        self.W_V = nn.Parameter(torch.empty(h, d, dh))
        self.W_O = nn.Parameter(torch.empty(h, dh, d))
        if cfg.use_bias:
            self.b_Q = nn.Parameter(torch.zeros(h, dh))
            self.b_K = nn.Parameter(torch.zeros(h, dh))
            self.b_V = nn.Parameter(torch.zeros(h, dh))
            self.b_O = nn.Parameter(torch.zeros(d))

    def bias(self, name: str) -> Tensor | None:
        return getattr(self, name) if self.cfg.use_bias else None

    def forward(
        self, q_in: Tensor, k_in: Tensor, v_in: Tensor, rec: _Recorder, frozen: Frozen | None
    ) -> Tensor:
        # q_in, k_in, v_in: [batch, pos, d_model] -> attn_out [batch, pos, d_model]
        cfg, prefix = self.cfg, f"blocks.{self.layer}.attn"
        n = q_in.shape[1]
        q = torch.einsum("bpd,hde->bphe", q_in, self.W_Q)  # [batch, pos, n_heads, d_head]
        k = torch.einsum("bpd,hde->bphe", k_in, self.W_K)
        v = torch.einsum("bpd,hde->bphe", v_in, self.W_V)
        if cfg.use_bias:
            q, k, v = q + self.b_Q, k + self.b_K, v + self.b_V
        if cfg.positional_embedding_type == "rotary":
            cos, sin = rotary_tables(cfg, n, q.device, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rec(f"{prefix}.hook_q", q), rec(f"{prefix}.hook_k", k), rec(f"{prefix}.hook_v", v)
        pattern_key = f"{prefix}.hook_pattern"
        if frozen is not None and pattern_key in frozen.patterns:
            pattern = frozen.patterns[pattern_key]  # [batch, n_heads, q_pos, k_pos]
            if pattern.shape[-1] != n:
                raise InvalidInputError(f"frozen pattern for layer {self.layer} has {pattern.shape[-1]} positions, input has {n}")
        else:
            scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / cfg.scale  # [batch, n_heads, q_pos, k_pos]
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            rec(f"{prefix}.hook_attn_scores", scores)
            pattern = scores.softmax(dim=-1)
        rec(pattern_key, pattern)
        z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)  # [batch, pos, n_heads, d_head]
        rec(f"{prefix}.hook_z", z)
        result_key = f"{prefix}.hook_result"
        if rec.wants(result_key):
            result = rec(result_key, torch.einsum("bqhe,hed->bqhd", z, self.W_O))  # [batch, pos, n_heads, d_model]
            out = result.sum(2)
        else:
            out = torch.einsum("bqhe,hed->bqd", z, self.W_O)
        if cfg.use_bias:
            out = out + self.b_O
        return out


def activation(name: str | None, x: Tensor) -> Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_new":
        return F.gelu(x, approximate="tanh")
    raise InvalidInputError(f"unknown act_fn {name!r}")


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        assert cfg.d_mlp is not None
        self.cfg, self.layer = cfg, layer
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        if cfg.use_bias:
            self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
            self.b_out = nn.Parameter(torch.zeros(cfg.d_model))

    def forward(self, x: Tensor, rec: _Recorder) -> Tensor:
        # x: [batch, pos, d_model] -> [batch, pos, d_model]
        pre = x @ self.W_in + (self.b_in if self.cfg.use_bias else 0)
        post = rec(f"blocks.{self.layer}.mlp.hook_post", activation(self.cfg.act_fn, rec(f"blocks.{self.layer}.mlp.hook_pre", pre)))
        return post @ self.W_out + (self.b_out if self.cfg.use_bias else 0)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ln1 = LayerNorm(cfg, f"blocks.{layer}.ln1")
        self.attn = Attention(cfg, layer)
        if not cfg.attn_only:
            self.ln2 = LayerNorm(cfg, f"blocks.{layer}.ln2")
            self.mlp = MLP(cfg, layer)

    def forward(self, resid: Tensor, pos: Tensor | None, rec: _Recorder, frozen: Frozen | None) -> Tensor:
        # resid: [batch, pos, d_model]; pos: [pos, d_model] (shortformer only)
        cfg, p = self.cfg, f"blocks.{self.layer}"
        rec(f"{p}.hook_resid_pre", resid)
        normed = self.ln1(resid, rec, frozen)
        qk_in = normed if pos is None else normed + pos
        v_in = normed
        if frozen is not None and self.layer in frozen.value_resid:
            v_in = self.ln1(frozen.value_resid[self.layer], _Recorder(None), frozen)
        attn_out = rec(f"{p}.hook_attn_out", self.attn(qk_in, qk_in, v_in, rec, frozen))
        if cfg.attn_only:
            return rec(f"{p}.hook_resid_post", resid + attn_out)
        if cfg.parallel_attn_mlp:
            mlp_out = rec(f"{p}.hook_mlp_out", self._mlp(resid, rec, frozen))
            return rec(f"{p}.hook_resid_post", resid + attn_out + mlp_out)
        mid = rec(f"{p}.hook_resid_mid", resid + attn_out)
        mlp_out = rec(f"{p}.hook_mlp_out", self._mlp(mid, rec, frozen))
        return rec(f"{p}.hook_resid_post", mid + mlp_out)

    def _mlp(self, x: Tensor, rec: _Recorder, frozen: Frozen | None) -> Tensor:
        # x: [batch, pos, d_model] -> [batch, pos, d_model]; a frozen output replaces ln2 and the MLP
        if frozen is not None and self.layer in frozen.mlp_out:
            out = frozen.mlp_out[self.layer]
            if out.shape != x.shape:
                raise InvalidInputError(f"frozen MLP output for layer {self.layer} has shape {tuple(out.shape)}, "
                                        f"the residual stream has {tuple(x.shape)}")
            return out
        return self.mlp(self.ln2(x, rec, frozen), rec)


class _Holder(nn.Module):
    """Gives parameters TransformerLens's dotted names (`embed.W_E`, `unembed.W_U`, ...).

    The annotations name the parameters Transformer.__init__ registers on its holders (embed: W_E,
    pos_embed: W_pos, unembed: W_U and b_U when cfg.use_bias), so attribute reads are typed as parameters.
    """

    W_E: nn.Parameter
    W_pos: nn.Parameter
    W_U: nn.Parameter
    b_U: nn.Parameter


class Transformer(nn.Module):
    """A decoder-only transformer with TransformerLens parameter names (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = _Holder()
        self.embed.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        if cfg.positional_embedding_type in ("standard", "shortformer"):
            self.pos_embed = _Holder()
            self.pos_embed.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))
        self.blocks = nn.ModuleList([Block(cfg, layer) for layer in range(cfg.n_layers)])
        self.ln_final = LayerNorm(cfg, "ln_final")
        self.unembed = _Holder()
        self.unembed.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        if cfg.use_bias:
            self.unembed.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))
        self.processing: dict[str, bool | str] = {}  # switch -> applied; '<switch>_skipped' -> why

    # Paper names for the weights, stacked over layers where TransformerLens stacks them.
    @property
    def W_E(self) -> Tensor:
        return self.embed.W_E  # [d_vocab, d_model]

    @property
    def W_pos(self) -> Tensor | None:
        return self.pos_embed.W_pos if hasattr(self, "pos_embed") else None  # [n_ctx, d_model]

    @property
    def W_U(self) -> Tensor:
        return self.unembed.W_U  # [d_model, d_vocab]

    @property
    def b_U(self) -> Tensor | None:
        return self.unembed.b_U if self.cfg.use_bias else None

    def _stack(self, name: str) -> Tensor:
        if self.cfg.n_layers == 0:
            raise InvalidInputError("the model has no attention layers")
        return torch.stack([getattr(b.attn, name) for b in self.blocks])

    @property
    def W_Q(self) -> Tensor:
        return self._stack("W_Q")  # [n_layers, n_heads, d_model, d_head]

    @property
    def W_K(self) -> Tensor:
        return self._stack("W_K")  # [n_layers, n_heads, d_model, d_head]

    @property
    def W_V(self) -> Tensor:
        return self._stack("W_V")  # [n_layers, n_heads, d_model, d_head]

    @property
    def W_O(self) -> Tensor:
        return self._stack("W_O")  # [n_layers, n_heads, d_head, d_model]

    def check_tokens(self, tokens: Tensor) -> Tensor:
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise InvalidInputError(f"tokens must be an integer tensor [batch, pos], got {tuple(tokens.shape)} {tokens.dtype}")
        n = tokens.shape[1]
        if n < 1 or n > self.cfg.n_ctx:
            raise InvalidInputError(f"sequence of {n} tokens does not fit the context of {self.cfg.n_ctx}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.d_vocab):
            raise InvalidInputError(f"token ids must be in [0, {self.cfg.d_vocab}), got {int(tokens.min())}..{int(tokens.max())}")
        return tokens.long()

    def embed_tokens(self, tokens: Tensor) -> tuple[Tensor, Tensor | None]:
        """x_0 [batch, pos, d_model] and the positional rows [pos, d_model] (None when not used)."""
        tokens = self.check_tokens(tokens)
        x0 = self.W_E[tokens]
        pos = self.W_pos[: tokens.shape[1]] if self.W_pos is not None else None
        return x0, pos

    def run(
        self,
        tokens: Tensor,
        names: NameFilter = None,
        frozen: Frozen | None = None,
        embeddings: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Logits [batch, pos, d_vocab] and the cached activations whose names pass `names`.

        `embeddings` replaces W_E[tokens] (x_0 before positions are added); with frozen patterns and
        LayerNorm scales the logits are an affine function of it.
        """
        rec = _Recorder(names)
        return self._forward(tokens, rec, frozen, embeddings), rec.cache

    def run_until(
        self,
        tokens: Tensor,
        stop_after: str,
        names: NameFilter = None,
        frozen: Frozen | None = None,
        embeddings: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The cache of `run` up to the hook `stop_after` (included); nothing after it is computed.

        E.g. stop_after="blocks.{L-1}.attn.hook_pattern" gives every pattern without the last layer's values
        output, its MLP, ln_final and the unembedding. An unknown hook name is an error (after a full run).
        """
        rec = _Recorder(names, stop_after=stop_after)
        try:
            self._forward(tokens, rec, frozen, embeddings)
        except _StopRun:
            return rec.cache
        raise InvalidInputError(f"no hook {stop_after!r} in this model's run")

    def _forward(self, tokens: Tensor, rec: _Recorder, frozen: Frozen | None, embeddings: Tensor | None) -> Tensor:
        tokens = self.check_tokens(tokens)
        x0, pos = self.embed_tokens(tokens)
        if embeddings is not None:
            x0 = embeddings
        resid = rec("hook_embed", x0)
        if pos is not None:
            rec("hook_pos_embed", pos[None].expand(x0.shape[0], -1, -1))
        if self.cfg.positional_embedding_type == "standard" and pos is not None:
            resid = resid + pos
        qk_pos = pos if self.cfg.positional_embedding_type == "shortformer" else None
        for block in self.blocks:
            resid = block(resid, qk_pos, rec, frozen)
        rec("hook_resid_final", resid)
        logits = self.ln_final(resid, rec, frozen) @ self.W_U
        if self.cfg.use_bias:
            logits = logits + self.unembed.b_U
        return logits

    def forward(self, tokens: Tensor) -> Tensor:
        return self.run(tokens)[0]

    @property
    def device(self) -> torch.device:
        return self.W_E.device

    @property
    def dtype(self) -> torch.dtype:
        return self.W_E.dtype


def next_token_losses(logits: Tensor, tokens: Tensor) -> Tensor:
    """Cross-entropy of predicting tokens[:, i + 1] from logits[:, i]: logits [batch, n, d_vocab], tokens
    [batch, n] -> [batch, n - 1] (column i is the loss on position i + 1)."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")


def init_weights(model: Transformer, seed: int = 0, std_embed: float = 0.02) -> Transformer:
    """Seeded random initialisation (training recipe of the toy models; also used by tests).

    W_E, W_pos ~ N(0, std_embed); W_Q, W_K, W_V ~ N(0, 1/sqrt(d_model)); W_O ~ N(0, 1/sqrt(d_model)/sqrt(2L));
    W_U ~ N(0, 1/sqrt(d_model)); MLP weights like W_Q and W_O. Biases zero, LayerNorm weights one.
    """
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    d = cfg.d_model
    out_std = d**-0.5 / max(1.0, (2 * cfg.n_layers) ** 0.5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("W_E", "W_pos"):
                std = std_embed
            elif leaf in ("W_O", "W_out"):
                std = out_std
            elif leaf.startswith("W_"):
                std = d**-0.5
            elif leaf == "w":
                param.fill_(1.0)
                continue
            else:
                param.zero_()
                continue
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype) * std)
    return model


def random_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, std_embed: float = 0.02) -> Transformer:
    """A seeded random model (tests, benchmarks)."""
    model = init_weights(Transformer(cfg), seed=seed, std_embed=std_embed)
    return model.to(dtype).requires_grad_(False)
