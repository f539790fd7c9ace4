"""Weight processing: TransformerLens's defaults, as exact rewrites that never change what the model computes.

Paper: "Handling Layer Normalization" appendix -- "we can fold everything but normalization into adjacent
parameters". Reference: TransformerLens `weight_processing.py` (docs/maths.md §4.3). Row-vector
convention, TransformerLens names and shapes (W_Q [n_heads, d_model, d_head], W_U [d_model, d_vocab]).

Switches (each recorded in `model.processing`: True = applied; when asked for but not valid for this model,
False plus `"<switch>_skipped": reason`):
- fold_ln: LN(x) = centre(x)/sigma * w + b feeds W_Q/W_K/W_V, W_in (and W_gate) and W_U, so w scales their
  rows and b becomes a bias: W <- diag(w) W, b_X <- b_X + b @ W. The reading weights are then centred over
  d_model (LNPre output has zero mean, so this is exact). The LayerNorms become "LNPre" (normalise only, keep
  hook_scale). A model without biases gets use_bias=True (zeros elsewhere) when some LN bias is non-zero.
  RMSNorm (x/rms * w, no bias): only w is folded, nothing is centred (RMSPre output does not have zero mean),
  and the norms become "RMSPre" (TransformerLens: fold_biases and center_weights off for RMS). Under
  grouped-query attention w is folded into the stored per-group `_W_K`, `_W_V`. Output norms (ln1_post, ln2_post)
  and QK-norm gains are never folded: each divides by the RMS of what it reads, which a folded gain would change.
  Multi-head latent attention: ln1's w folds into the projections that read the stream (W_DQ, or W_UQ and W_QR
  without a query latent; W_DKV, W_KR), never past the latent norms.
  Skipped for shortformer positions: W_pos is added *after* ln1 to the query/key inputs, so folding ln1.w
  into W_Q/W_K would also scale the positional path (TransformerLens skips it too). Skipped for a gated MLP
  whose ln2 has a non-zero bias: TransformerLens's gated MLP adds b_in after the gate product, so
  b_ln2 W_in has no bias to go to.
- center_writing_weights: subtract the d_model mean from W_E, W_pos (standard positions only), W_O, b_O,
  W_out, b_out. Exact only because every reader of the residual stream is a LayerNorm that centres first;
  skipped for models without LayerNorm and for RMSNorm models (RMSNorm does not subtract the mean).
- center_unembed: W_U <- W_U - mean over vocab, b_U likewise: every logit at a position moves by the same
  amount, so log-probs are unchanged. Skipped when the logits are soft-capped (Gemma 2): the cap is not
  shift-equivariant.
- Shortformer models (the paper's): like TransformerLens's from_pretrained, neither centring is applied.
  Both are exact for log-probs, but they change circuit numbers: centring W_U subtracts a rank-one term
  from every full OV circuit W_E W_OV W_U, which moves its eigenvalue copying score (on toy-2l, L0H0 goes
  from 0.97 to 0.28), so qkov's numbers would stop agreeing with TransformerLens's on the paper's models.
- fold_value_biases: each attention row sums to 1 (not under learned sinks: skipped), so b_V^h contributes the
constant b_V^h W_O^h to every
  position: b_O <- b_O + sum_h b_V^h W_O^h, b_V <- 0 (under GQA, b_V^h is its group's `_b_V`).

Unlike TransformerLens (which casts to float32 while processing), the dtype is kept: float64 stays float64.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.errors import InvalidInputError
from circuits_core.formats.statedict import build_model
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, attn_param

State = dict[str, Tensor]
SWITCHES = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")


@dataclass(frozen=True)
class ProcessingOptions:
    """Which processing steps `load_checkpoint` applies (all on: TransformerLens's `from_pretrained`)."""

    fold_ln: bool = True
    center_writing_weights: bool = True
    center_unembed: bool = True
    fold_value_biases: bool = True

    @classmethod
    def none(cls) -> ProcessingOptions:
        return cls(False, False, False, False)

    @classmethod
    def from_json(cls, value: object) -> ProcessingOptions:
        """`true` / `false` (every switch) or `{"fold_ln": false, ...}` (switches not named stay on)."""
        if isinstance(value, bool):
            return cls() if value else cls.none()
        if not isinstance(value, dict):
            raise InvalidInputError(f"processing must be true, false or an object of switches, got {value!r}")
        unknown = sorted(set(value) - set(SWITCHES))
        if unknown:
            raise InvalidInputError(f"unknown processing switch(es) {', '.join(unknown)}; valid: {', '.join(SWITCHES)}")
        wrong = [k for k, v in value.items() if not isinstance(v, bool)]
        if wrong:
            raise InvalidInputError(f"processing switches must be true or false: {', '.join(wrong)}")
        return cls(**value)


def _bias_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every bias key of a use_bias model, with its shape."""
    h, g, dh, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model
    b_K, b_V = attn_param(cfg, "b_K"), attn_param(cfg, "b_V")
    shapes: dict[str, tuple[int, ...]] = {"unembed.b_U": (cfg.d_vocab,)}
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        shapes.update({f"{p}.attn.b_Q": (h, dh), f"{p}.attn.{b_K}": (g, dh), f"{p}.attn.{b_V}": (g, dh)})
        shapes[f"{p}.attn.b_O"] = (d,)
        if not cfg.attn_only:
            assert cfg.d_mlp is not None
            shapes.update({f"{p}.mlp.b_in": (cfg.d_mlp,), f"{p}.mlp.b_out": (d,)})
    return shapes


def _fold_ln(cfg: ModelConfig, sd: State, record: dict[str, bool | str]) -> ModelConfig:
    """Fold every norm's w (and LN's b) into the weights reading it; returns the new config (LNPre / RMSPre)."""
    if cfg.normalization_type not in ("LN", "RMS"):
        record["fold_ln"] = True  # nothing to fold: LNPre / RMSPre (already folded) or no norm
        return cfg
    if cfg.positional_embedding_type == "shortformer":
        record["fold_ln_skipped"] = (
            "shortformer positions are added after ln1, so folding ln1.w into W_Q/W_K would also scale W_pos"
        )
        return cfg
    rms = cfg.normalization_type == "RMS"
    # Input norms only (OLMo 2 has none); output norms (ln1_post, ln2_post) keep their gains: nothing linear follows
    # them
    # before the residual add, and folding into W_O would change the RMS they divide by.
    inputs = (1,) if cfg.attn_only else (1, 2)
    ln_names = [f"blocks.{layer}.ln{i}" for layer in range(cfg.n_layers) for i in inputs] if cfg.pre_norms else []
    ln_names.append("ln_final")
    if cfg.gated_mlp and not rms and any(bool(sd[f"blocks.{layer}.ln2.b"].any()) for layer in range(cfg.n_layers)):
        record["fold_ln_skipped"] = (
            "gated MLP with an ln2 bias: the gated MLP adds b_in after the gate product (TransformerLens's "
            "GatedMLP), so b_ln2 W_in and b_ln2 W_gate have no bias to go to"
        )
        return cfg
    use_bias = cfg.use_bias or (not rms and any(bool(sd[f"{ln}.b"].any()) for ln in ln_names))
    if use_bias and not cfg.use_bias:
        ref = sd["embed.W_E"]
        for key, shape in _bias_shapes(cfg).items():
            sd[key] = torch.zeros(shape, dtype=ref.dtype, device=ref.device)

    def fold(ln: str, weight_key: str, bias_key: str | None) -> None:
        w = sd[f"{ln}.w"]  # [d_model]
        W = sd[weight_key]  # [heads, d_model, d_head] or [d_model, d_out]
        if not rms and use_bias and bias_key is not None:
            sd[bias_key] = sd[bias_key] + sd[f"{ln}.b"] @ W  # [..., d_out]
        W.mul_(w[:, None])  # scales row d (broadcasts over a leading head axis)
        if not rms:
            W.sub_(W.mean(dim=-2, keepdim=True))  # centre the reading weights over d_model

    for layer in range(cfg.n_layers if cfg.pre_norms else 0):
        p = f"blocks.{layer}"
        if cfg.latent_attention:  # the projections that read the stream (latent_attention.py)
            readers = ["W_DKV", "W_KR", *(("W_DQ",) if cfg.mla_q_rank is not None else ("W_UQ", "W_QR"))]
            for name in readers:
                fold(f"{p}.ln1", f"{p}.attn.{name}", None)
        else:
            for x in "QKV":
                fold(f"{p}.ln1", f"{p}.attn.{attn_param(cfg, 'W_' + x)}", f"{p}.attn.{attn_param(cfg, 'b_' + x)}")
        if not cfg.attn_only:
            fold(f"{p}.ln2", f"{p}.mlp.W_in", None if cfg.gated_mlp else f"{p}.mlp.b_in")
            if cfg.gated_mlp:  # (a mixture of experts: every expert's [n_experts, d_model, d_mlp], and the router)
                fold(f"{p}.ln2", f"{p}.mlp.W_gate", None)
            if cfg.layer_has_experts(layer):
                fold(f"{p}.ln2", f"{p}.mlp.W_router", None)
                if cfg.moe_shared_d_mlp is not None:
                    fold(f"{p}.ln2", f"{p}.mlp.W_shared_gate", None)
                    fold(f"{p}.ln2", f"{p}.mlp.W_shared_in", None)
    fold("ln_final", "unembed.W_U", "unembed.b_U")
    for ln in ln_names:
        for leaf in ("w", "b"):
            sd.pop(f"{ln}.{leaf}", None)
    record["fold_ln"] = True
    return dataclasses.replace(cfg, normalization_type="RMSPre" if rms else "LNPre", use_bias=use_bias)


SHORTFORMER_SKIP = (
    "shortformer model: TransformerLens's from_pretrained turns this off for shortformer models, and qkov "
    "follows it so circuit numbers (e.g. OV eigenvalue copying scores, which centring changes) agree"
)


def _center_writing_weights(cfg: ModelConfig, sd: State, record: dict[str, bool | str]) -> None:
    if cfg.positional_embedding_type == "shortformer":
        record["center_writing_weights_skipped"] = SHORTFORMER_SKIP
        return
    if cfg.normalization_type not in ("LN", "LNPre"):
        record["center_writing_weights_skipped"] = (
            "RMSNorm does not subtract the mean, so readers see the residual mean: centring would change the output"
            if cfg.uses_rms
            else "the model has no LayerNorm, so readers see the residual mean: centring would change the output"
        )
        return
    writers = ["embed.W_E"]
    if cfg.positional_embedding_type == "standard":
        writers.append("pos_embed.W_pos")
    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        writers += [f"{p}.attn.W_O", f"{p}.attn.b_O", f"{p}.mlp.W_out", f"{p}.mlp.b_out"]
    for key in writers:
        if key in sd:  # biases exist only with use_bias, MLP weights only with MLPs
            sd[key].sub_(sd[key].mean(dim=-1, keepdim=True))  # mean over d_model
    record["center_writing_weights"] = True


def _center_unembed(cfg: ModelConfig, sd: State, record: dict[str, bool | str]) -> None:
    if cfg.positional_embedding_type == "shortformer":
        record["center_unembed_skipped"] = SHORTFORMER_SKIP
        return
    if cfg.output_logits_soft_cap is not None:
        record["center_unembed_skipped"] = (
            "the logits are soft-capped: c tanh((z - m) / c) is not c tanh(z / c) - m, so moving every logit by the "
            "same amount before the cap would change the log-probs"
        )
        return
    sd["unembed.W_U"].sub_(sd["unembed.W_U"].mean(dim=-1, keepdim=True))  # [d_model, d_vocab]
    if "unembed.b_U" in sd:
        sd["unembed.b_U"] = sd["unembed.b_U"] - sd["unembed.b_U"].mean()
    record["center_unembed"] = True


def _fold_value_biases(cfg: ModelConfig, sd: State, record: dict[str, bool | str]) -> None:
    if cfg.attn_sinks:
        record["fold_value_biases_skipped"] = (
            "learned attention sinks: a pattern row sums to less than 1 (the sink keeps the rest), so b_V W_O "
            "reaches each position scaled by its row sum, not as a constant"
        )
        return
    if cfg.use_bias:
        for layer in range(cfg.n_layers):
            p, b_V_key = f"blocks.{layer}.attn", f"blocks.{layer}.attn.{attn_param(cfg, 'b_V')}"
            b_V = sd[b_V_key].repeat_interleave(cfg.group_size, dim=0)  # [n_heads, d_head] (per query head)
            W_O = sd[f"{p}.W_O"]  # [n_heads, d_head, d_model]
            sd[f"{p}.b_O"] = sd[f"{p}.b_O"] + torch.einsum("he,hed->d", b_V, W_O)
            sd[b_V_key] = torch.zeros_like(sd[b_V_key])
    record["fold_value_biases"] = True


def own_tensors(sd: State) -> State:
    """The same entries, each with a storage of its own (tied weights such as GPT-2's W_U = W_E^T are cloned),
    so `process_state` can work in place."""
    seen: set[int] = set()
    owned: State = {}
    for key, value in sd.items():
        ptr = value.untyped_storage().data_ptr()
        owned[key] = value.clone() if ptr in seen else value
        seen.add(ptr)
    return owned


def process_state(
    cfg: ModelConfig, sd: State, options: ProcessingOptions, record: dict[str, bool | str]
) -> ModelConfig:
    """Apply the chosen rewrites to a checked state dict in place: large tensors are modified in place, so
    the caller must own them (no storage shared with a live model or between entries: see `own_tensors`).

    Returns the new config; `record` receives the switches applied and the reasons for skipped ones.
    """
    if options.fold_ln:
        cfg = _fold_ln(cfg, sd, record)
    if options.center_writing_weights:
        _center_writing_weights(cfg, sd, record)
    if options.center_unembed:
        _center_unembed(cfg, sd, record)
    if options.fold_value_biases:
        _fold_value_biases(cfg, sd, record)
    return cfg


def process_weights(
    model: Transformer,
    fold_ln: bool = True,
    center_writing_weights: bool = True,
    center_unembed: bool = True,
    fold_value_biases: bool = True,
) -> Transformer:
    """A new model with the chosen rewrites applied (same dtype and device); `model` is not modified."""
    options = ProcessingOptions(fold_ln, center_writing_weights, center_unembed, fold_value_biases)
    sd: State = {k: v.detach().clone() for k, v in model.state_dict().items()}  # `model` stays untouched
    record: dict[str, bool | str] = {s: bool(model.processing.get(s, False)) for s in SWITCHES}
    record.update({k: v for k, v in model.processing.items() if k.endswith("_skipped")})
    cfg = process_state(model.cfg, sd, options, record)
    new = build_model(cfg, sd, dtype=model.dtype, origin="process_weights").to(model.device)
    new.processing = record
    return new
