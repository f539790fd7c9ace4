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
Llama family (TransformerLens 3.9 names): RMS norms have `w` only (RMSPre nothing); grouped-query attention
stores blocks.{l}.attn._W_K/_W_V [n_kv_heads, d_model, d_head], _b_K/_b_V [n_kv_heads, d_head] (attn.W_K etc.
and the stacked model.W_K stay per query head); gated MLPs add blocks.{l}.mlp.W_gate [d_model, d_mlp].
The newest attention (Gemma 2/3, Qwen3, OLMo 2/3): QK-norm gains blocks.{l}.attn.q_norm.w / k_norm.w (qk_norm.py),
output norms blocks.{l}.ln1_post.w / ln2_post.w (norm.py; hook_attn_out and hook_mlp_out are after them, what the
stream receives), no ln1 / ln2 without input norms (OLMo), soft caps (soft_cap.py; hook_logits_uncapped holds the
logits before the final cap), sliding windows and a rope per layer (window.py, ModelConfig.layer_rope).
Mixture-of-experts layers (moe.py) stack their experts: mlp.W_router [d_model, n_experts], mlp.W_gate / W_in
[n_experts, d_model, d_mlp], W_out [n_experts, d_mlp, d_model]; learned sinks add blocks.{l}.attn.sinks [n_heads].
Multi-head latent attention (DeepSeek-V2/V3: latent_attention.py) stores its latent projections instead of per-head
W_Q, W_K, W_V (which it computes, with the same shapes).

Positions: `standard` adds W_pos to the residual stream; `shortformer` (the paper's models) adds it to the
query and key inputs only, after ln1; `rotary` rotates q and k by position (rope.py's `rotate`: the first
rotary_dim dimensions, rotate-half or adjacent pairs, with the config's rope scaling); `none` has no positions.
Under GQA the hooks hook_k and hook_v hold one entry per *query* head (TransformerLens's
`ungroup_grouped_query_attention`), and hook_q / hook_k are after the rotation (TransformerLens's hook_rot_q).

`run()` returns logits and, on request, a cache of named activations with TransformerLens hook names.
Frozen runs (`Frozen`): attention patterns and LayerNorm scales (and, on request, MLP outputs) taken from a
previous run instead of being computed. With both frozen, the network is linear in its input embeddings (the paper's
"freezing attention patterns" trick) -- the path expansions stand on this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from circuits_core.errors import InvalidInputError
from circuits_core.model.attention import Attention as Attention  # attention.py, re-exported (announced names)
from circuits_core.model.attention import attn_param as attn_param
from circuits_core.model.config import ModelConfig
from circuits_core.model.hooks import Frozen as Frozen  # hooks.py, re-exported (announced names)
from circuits_core.model.hooks import NameFilter, Recorder, StopRun
from circuits_core.model.latent_attention import LatentAttention
from circuits_core.model.linear import affine
from circuits_core.model.mlp import MLP
from circuits_core.model.moe import MoE
from circuits_core.model.norm import LayerNorm as LayerNorm  # norm.py, re-exported (announced names)
from circuits_core.model.norm import input_norm, output_norm
from circuits_core.model.rope import rotary_angles as rotary_angles  # rope.py, re-exported (announced names)
from circuits_core.model.rope import rotary_inv_freq as rotary_inv_freq
from circuits_core.model.rope import rotary_pairs as rotary_pairs
from circuits_core.model.rope import rotate as rotate
from circuits_core.model.soft_cap import soft_cap
from circuits_core.schedule import give_way


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ln1 = input_norm(cfg, f"blocks.{layer}.ln1")
        self.attn = LatentAttention(cfg, layer) if cfg.latent_attention else Attention(cfg, layer)
        if cfg.post_norms:
            self.ln1_post = output_norm(cfg, f"blocks.{layer}.ln1_post")
        if not cfg.attn_only:
            self.ln2 = input_norm(cfg, f"blocks.{layer}.ln2")
            self.mlp: MLP | MoE = MoE(cfg, layer) if cfg.layer_has_experts(layer) else MLP(cfg, layer)
            if cfg.post_norms:
                self.ln2_post = output_norm(cfg, f"blocks.{layer}.ln2_post")

    def forward(self, resid: Tensor, pos: Tensor | None, rec: Recorder, frozen: Frozen | None) -> Tensor:
        # resid: [batch, pos, d_model]; pos: [pos, d_model] (shortformer only)
        cfg, p = self.cfg, f"blocks.{self.layer}"
        rec(f"{p}.hook_resid_pre", resid)
        normed = self.ln1(resid, rec, frozen)
        qk_in = normed if pos is None else normed + pos
        v_in = normed
        if frozen is not None and self.layer in frozen.value_resid:
            v_in = self.ln1(frozen.value_resid[self.layer], Recorder(None), frozen)
        attn_out = self.attn(qk_in, qk_in, v_in, rec, frozen)
        if cfg.post_norms:  # hook_attn_out: what is added to the stream (after the output norm, as TransformerLens)
            attn_out = self.ln1_post(attn_out, rec, frozen)
        attn_out = rec(f"{p}.hook_attn_out", attn_out)
        if cfg.attn_only:
            return rec(f"{p}.hook_resid_post", resid + attn_out)
        if cfg.parallel_attn_mlp:
            mlp_out = rec(f"{p}.hook_mlp_out", self._mlp(resid, rec, frozen))
            return rec(f"{p}.hook_resid_post", resid + attn_out + mlp_out)
        mid = rec(f"{p}.hook_resid_mid", resid + attn_out)
        mlp_out = rec(f"{p}.hook_mlp_out", self._mlp(mid, rec, frozen))
        return rec(f"{p}.hook_resid_post", mid + mlp_out)

    def _mlp(self, x: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        # x: [batch, pos, d_model] -> [batch, pos, d_model]; a frozen output replaces ln2 and the MLP
        if frozen is not None and self.layer in frozen.mlp_out:
            out = frozen.mlp_out[self.layer]
            if out.shape != x.shape:
                raise InvalidInputError(
                    f"frozen MLP output for layer {self.layer} has shape {tuple(out.shape)}, "
                    f"the residual stream has {tuple(x.shape)}"
                )
            return out
        normed = self.ln2(x, rec, frozen)
        out = self.mlp(normed, rec, frozen) if isinstance(self.mlp, MoE) else self.mlp(normed, rec)
        return self.ln2_post(out, rec, frozen) if self.cfg.post_norms else out


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

    def _stack(self, name: str, grouped: bool = False) -> Tensor:
        if self.cfg.n_layers == 0:
            raise InvalidInputError("the model has no attention layers")
        attns = [block.attn for block in self.blocks if isinstance(block, Block)]
        return torch.stack([attn.grouped(name) if grouped else getattr(attn, name) for attn in attns])

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

    @property
    def W_K_groups(self) -> Tensor:
        """W_K per key/value head, as stored [n_layers, n_kv_heads, d_model, d_head] (= W_K without GQA)."""
        return self._stack("W_K", grouped=True)

    def rotate(self, x: Tensor, positions: Tensor, layer: int | None = None) -> Tensor:
        """x R(p) in this model's rotary layout (see the module-level `rotate`), with layer `layer`'s rope (its own base
        on a local layer, ModelConfig.layer_rope); None: the global layers' rope."""
        return rotate(self.cfg if layer is None else self.cfg.layer_rope(layer), x, positions)

    def check_tokens(self, tokens: Tensor) -> Tensor:
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise InvalidInputError(
                f"tokens must be an integer tensor [batch, pos], got {tuple(tokens.shape)} {tokens.dtype}"
            )
        n = tokens.shape[1]
        if n < 1 or n > self.cfg.n_ctx:
            raise InvalidInputError(f"sequence of {n} tokens does not fit the context of {self.cfg.n_ctx}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.d_vocab):
            raise InvalidInputError(
                f"token ids must be in [0, {self.cfg.d_vocab}), got {int(tokens.min())}..{int(tokens.max())}"
            )
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
        rec = Recorder(names)
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
        rec = Recorder(names, stop_after=stop_after)
        try:
            self._forward(tokens, rec, frozen, embeddings)
        except StopRun:
            return rec.cache
        raise InvalidInputError(f"no hook {stop_after!r} in this model's run")

    def _forward(self, tokens: Tensor, rec: Recorder, frozen: Frozen | None, embeddings: Tensor | None) -> Tensor:
        tokens = self.check_tokens(tokens)
        x0, pos = self.embed_tokens(tokens)
        if embeddings is not None:
            x0 = embeddings
        resid = rec("hook_embed", x0)
        if pos is not None:
            rec("hook_pos_embed", pos[None].expand(x0.shape[0], -1, -1))
        if self.cfg.positional_embedding_type == "standard" and pos is not None:
            resid = resid + pos
        resid = self._layers(resid, 0, rec, frozen)
        rec("hook_resid_final", resid)
        return self.unembed_resid(resid, rec, frozen)

    def _layers(
        self, resid: Tensor, start: int, rec: Recorder, frozen: Frozen | None, stop: int | None = None
    ) -> Tensor:
        # resid: [batch, pos, d_model] entering layer `start` -> the stream entering layer `stop` (None: after the last)
        W_pos = self.W_pos if self.cfg.positional_embedding_type == "shortformer" else None
        qk_pos = W_pos[: resid.shape[1]] if W_pos is not None else None
        for block in self.blocks[start:stop]:
            give_way()  # a background job's helper thread pauses here while a request wants its core (schedule.py)
            resid = block(resid, qk_pos, rec, frozen)
        return resid

    def run_from(
        self, resid: Tensor, start: int, names: NameFilter = None, frozen: Frozen | None = None, stop: int | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The stream after the last layer [batch, pos, d_model] (hook_resid_final, before ln_final; with `stop`: the
        stream entering layer `stop`) and the cache of `names`, running only layers start..n_layers-1 (..stop-1) from
        `resid`, the stream entering layer `start` (its hook_resid_pre) [batch, pos, d_model]: the layers before it
        are not run (reruns that change nothing before `start`). Positions come from the sequence length
        (shortformer rows, rotary angles), as in `run`."""
        last = self.cfg.n_layers if stop is None else stop
        if not 0 <= start <= last <= self.cfg.n_layers:
            raise InvalidInputError(f"layers {start}..{last} are outside 0..{self.cfg.n_layers}")
        rec = Recorder(names)
        return self._layers(resid, start, rec, frozen, stop), rec.cache

    def unembed_resid(self, resid: Tensor, rec: Recorder | None = None, frozen: Frozen | None = None) -> Tensor:
        """Logits [batch, pos, d_vocab] of the stream after the last layer [batch, pos, d_model]: ln_final (its frozen
        scale when `frozen` has one), W_U, b_U."""
        rec = rec or Recorder(None)
        logits = affine(self.ln_final(resid, rec, frozen), self.W_U, self.b_U)  # [batch, pos, d_vocab]
        if self.cfg.output_logits_soft_cap is None:
            return logits
        rec("hook_logits_uncapped", logits)
        return soft_cap(logits, self.cfg.output_logits_soft_cap)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.run(tokens)[0]

    @property
    def device(self) -> torch.device:
        return self.W_E.device

    @property
    def dtype(self) -> torch.dtype:
        return self.W_E.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype circuit computations on these weights run in: float32 for half-precision weights, else theirs."""
        return torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype


# Bytes of one block of next_token_losses: its logits in the loss's dtype (their log-softmax as much again). Below
# glibc's mmap threshold (32 MiB as the benches fix it), so each block reuses the heap's pages: converting a detector
# chunk's logits to float64 at once ([3, 101, 49152]: 119 MB, then as much for the rows and their log-softmax) took
# 175 ms and 87k page faults, in blocks 50 ms and 3k (one thread, alternated in one process)
LOSS_BLOCK_BYTES = 16 * 2**20


def next_token_losses(logits: Tensor, tokens: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Cross-entropy of predicting tokens[:, i + 1] from logits[:, i] in `dtype` (default: the logits'): logits
    [batch, n, d_vocab], tokens [batch, n] -> [batch, n - 1] (column i is the loss on position i + 1). The positions
    go a block at a time (whole sequences when several fit in LOSS_BLOCK_BYTES), each block converted to `dtype` on its
    own: every row's log-softmax is its own, so the losses are those of the whole logits at once."""
    b, n, V = logits.shape
    dtype = logits.dtype if dtype is None else dtype
    rows = max(1, LOSS_BLOCK_BYTES // (V * dtype.itemsize))  # positions per block
    per_block = max(1, rows // max(1, n - 1))  # whole sequences per block (1: a sequence's positions in blocks)
    positions = max(1, min(n - 1, rows))
    out = torch.empty(b, n - 1, dtype=dtype, device=logits.device)
    for s in range(0, b, per_block):
        for a in range(0, n - 1, positions):
            z = min(a + positions, n - 1)
            # rows of contiguous logits: 8x faster than the class dimension in the middle ([b, V, n - 1]) on a 50k
            # vocabulary
            block = logits[s : s + per_block, a:z].reshape(-1, V).to(dtype)  # [rows, V]
            losses = F.cross_entropy(block, tokens[s : s + per_block, a + 1 : z + 1].reshape(-1), reduction="none")
            out[s : s + per_block, a:z] = losses.view(-1, z - a)
    return out


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
            leaf = name.rsplit(".", 1)[-1].lstrip("_")  # _W_K, _W_V: grouped-query K/V
            if leaf in ("W_E", "W_pos"):
                std = std_embed
            elif leaf in ("W_O", "W_out"):  # (a mixture-of-experts W_out [n_experts, d_mlp, d_model] too)
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


def random_model(
    cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, std_embed: float = 0.02
) -> Transformer:
    """A seeded random model (tests, benchmarks)."""
    model = init_weights(Transformer(cfg), seed=seed, std_embed=std_embed)
    return model.to(dtype).requires_grad_(False)
