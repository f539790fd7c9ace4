"""Model configuration: `ModelConfig`, the shape and architecture of a transformer.

Field names follow TransformerLens's HookedTransformerConfig where they exist, so a TransformerLens
`config.json` loads as it is. Heads are named `L{layer}H{head}` everywhere (head_names.py).

Every field is checked against its type annotation (`check_fields`, field_checks.py: int never bool, float accepts
int, Literal, `X | None`) and the bounds in its `metadata` ({"ge": 1}, {"gt": 0}, {"le": MAX_LAYERS}), so a new
field is checked by declaring it precisely; an error names the field. Raw Hugging Face configs are read with
`ConfigReader` (config_reader.py), whose errors also name the field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from circuits_core.errors import InvalidInputError
from circuits_core.model.field_checks import check_fields, show_value
from circuits_core.model.head_names import head_name

NormalizationType = Literal["LN", "LNPre", "RMS", "RMSPre"] | None
PositionalType = Literal["standard", "shortformer", "rotary", "none"]
ActFn = Literal["gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu"]
RopeType = Literal["default", "linear", "llama3", "yarn"]
QKNormType = Literal["head", "layer"] | None
AttnType = Literal["global", "local"]

NORMALIZATION_TYPES: tuple[str | None, ...] = ("LN", "LNPre", "RMS", "RMSPre", None)
POSITIONAL_TYPES: tuple[str, ...] = ("standard", "shortformer", "rotary", "none")
ACT_FNS: tuple[str, ...] = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
# Structural caps (beyond them a config is refused as absurd before anything is built): the largest served
# transformers have ~130 layers and ~128 heads per layer.
MAX_LAYERS = 1024
MAX_HEADS = 1024


@dataclass(frozen=True)
class ModelConfig:
    """Shape and architecture of a transformer (TransformerLens field names)."""

    n_layers: int = field(metadata={"ge": 0, "le": MAX_LAYERS})
    d_model: int = field(metadata={"ge": 1})
    n_heads: int = field(metadata={"ge": 1, "le": MAX_HEADS})
    d_head: int = field(metadata={"ge": 1})
    d_vocab: int = field(metadata={"ge": 1})
    n_ctx: int = field(metadata={"ge": 1})
    d_mlp: int | None = field(default=None, metadata={"ge": 1})
    attn_only: bool = True
    normalization_type: NormalizationType = None
    positional_embedding_type: PositionalType = "shortformer"
    act_fn: ActFn | None = None
    eps: float = field(default=1e-5, metadata={"gt": 0})
    # Biases: when False the model has no b_Q/b_K/b_V/b_O/b_in/b_out/b_U at all.
    use_bias: bool = False
    # GPT-NeoX style: attention and MLP both read resid_pre (with their own LayerNorms).
    parallel_attn_mlp: bool = False
    rotary_dim: int | None = field(default=None, metadata={"ge": 2})
    rotary_base: float = field(default=10000.0, metadata={"gt": 0})
    # Llama family (TransformerLens names where TransformerLens has them):
    # Grouped-query attention: query head h reads key/value head h // (n_heads // n_key_value_heads). When set
    # (even to n_heads), K/V are stored per key/value head as `_W_K`, `_W_V`, `_b_K`, `_b_V` (TransformerLens's
    # GroupedQueryAttention); None: one K/V per query head (`W_K`, `W_V`).
    n_key_value_heads: int | None = field(default=None, metadata={"ge": 1, "le": MAX_HEADS})
    # Gated MLP (TransformerLens GatedMLP): out = (act(x W_gate) * (x W_in) + b_in) W_out + b_out.
    gated_mlp: bool = False
    # Rotary layout: False pairs dim i with i + rotary_dim/2 (rotate-half, Hugging Face files); True pairs
    # (2i, 2i+1) (GGUF files, GPT-J).
    rotary_adjacent_pairs: bool = False
    # Rope scaling of the frequencies theta_k = rotary_base^(-2k/rotary_dim) (Hugging Face `rope_type`):
    # "default" none; "linear" theta_k / rope_factor; "llama3" Llama 3.1's smooth interpolation using
    # rope_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position_embeddings.
    # A factor set while the type is "default" is refused (the type must be named).
    rope_type: RopeType = "default"
    rope_factor: float = field(default=1.0, metadata={"gt": 0})
    rope_low_freq_factor: float = field(default=1.0, metadata={"gt": 0})
    rope_high_freq_factor: float = field(default=4.0, metadata={"gt": 0})
    rope_original_max_position_embeddings: int = field(default=8192, metadata={"ge": 1})
    # "yarn" (YaRN, as transformers computes it): a linear ramp between beta_fast and beta_slow rotations over the
    # original context mixes theta_k and theta_k / rope_factor; truncate rounds the ramp's ends. YaRN's attention
    # factor (cos and sin scaled by it) is a score scale: loaders fold its square into attn_scale.
    rope_beta_fast: float = field(default=32.0, metadata={"gt": 0})
    rope_beta_slow: float = field(default=1.0, metadata={"gt": 0})
    rope_truncate: bool = True
    # Learned attention sinks (gpt-oss): one logit b_h per head (attn.sinks [n_heads]) joins every softmax row as
    # an extra key that carries no value, so pattern rows sum to sigma(LSE_j s_ij - b_h) < 1 (never renormalised).
    attn_sinks: bool = False
    # Mixture-of-experts MLP (moe.py), TransformerLens names: num_experts gated experts, experts_per_token chosen
    # per token by the router x W_router (+ b_router). moe_norm_topk: the chosen weights are the softmax over the
    # chosen logits (Mixtral, gpt-oss), else the full softmax's top-k entries (OLMoE, Qwen3-MoE's default).
    # clamped_swiglu: gpt-oss's expert (gate clamped above at swiglu_limit, up clamped to +-swiglu_limit,
    # out = (up + 1) gate sigmoid(swiglu_alpha gate)) instead of silu(gate) up.
    # ALiBi (alibi.py): no positions in the stream; head h adds -m_h (i - j) to its scores, with the slopes m_h by
    # BLOOM's rule or MPT's (alibi_bias_max), which differ when n_heads is not a power of two.
    alibi: Literal["bloom", "mpt"] | None = None
    alibi_bias_max: float = field(default=8.0, metadata={"gt": 0})
    num_experts: int | None = field(default=None, metadata={"ge": 1})
    experts_per_token: int = field(default=1, metadata={"ge": 1})
    moe_norm_topk: bool = True
    clamped_swiglu: bool = False
    swiglu_alpha: float = field(default=1.702, metadata={"gt": 0})
    swiglu_limit: float = field(default=7.0, metadata={"gt": 0})
    # DeepSeek's mixture of experts (moe.py): the router scores experts by a softmax (V2) or a sigmoid (V3, whose
    # choice adds a learned bias mlp.b_choice); group-limited routing keeps the moe_topk_groups best of moe_n_groups
    # expert groups first; the chosen weights are multiplied by moe_routed_scale; moe_shared_d_mlp: always-on shared
    # experts (one gated MLP of that width); the first moe_dense_layers layers are dense MLPs of width d_mlp_dense.
    moe_scoring: Literal["softmax", "sigmoid"] = "softmax"
    moe_n_groups: int | None = field(default=None, metadata={"ge": 1})
    moe_topk_groups: int | None = field(default=None, metadata={"ge": 1})
    moe_routed_scale: float = field(default=1.0, metadata={"gt": 0})
    moe_shared_d_mlp: int | None = field(default=None, metadata={"ge": 1})
    moe_dense_layers: int = field(default=0, metadata={"ge": 0})
    d_mlp_dense: int | None = field(default=None, metadata={"ge": 1})
    # Multi-head latent attention (DeepSeek-V2/V3; latent_attention.py), set by mla_kv_rank: queries read a latent of
    # rank mla_q_rank (None: x directly, V2-Lite), keys and values one shared latent of rank mla_kv_rank, each
    # RMS-normalised; per head mla_d_nope content dims and rotary_dim rotary dims (the key's rotary part shared by
    # every head), mla_d_v value dims. d_head = max(mla_d_nope + rotary_dim, mla_d_v): per-head q and k are
    # laid out [rope | nope | zeros], v [v | zeros], so W_Q, W_K, W_V, W_O keep TransformerLens's shapes.
    mla_q_rank: int | None = field(default=None, metadata={"ge": 1})
    mla_kv_rank: int | None = field(default=None, metadata={"ge": 1})
    mla_d_nope: int = field(default=0, metadata={"ge": 0})
    mla_d_v: int = field(default=0, metadata={"ge": 0})
    # Divisor of q.k; defaults to sqrt(d_head) (TransformerLens `attn_scale`).
    attn_scale: float | None = field(default=None, metadata={"gt": 0})
    bos_token_id: int | None = field(default=None, metadata={"ge": 0})
    # The newest attention (qk_norm.py, soft_cap.py, window.py, norm.py document each; TransformerLens names where it
    # has them).
    # QK-norm: q and k RMS-normalised after projection, before the rotation, with gains attn.q_norm.w, attn.k_norm.w:
    # "head" over each head's d_head (Qwen3, Gemma 3), "layer" over all heads of the layer (OLMo 2/3).
    qk_norm: QKNormType = None
    # Soft-capping s -> c tanh(s / c) of the scaled attention scores (before the mask) and of the logits (Gemma 2).
    attn_scores_soft_cap: float | None = field(default=None, metadata={"gt": 0})
    output_logits_soft_cap: float | None = field(default=None, metadata={"gt": 0})
    # Sliding windows: on a "local" layer query i sees key j only when i - j < window_size. attn_types names each
    # layer's kind; None with window_size set: every layer is local (Mistral v0.1).
    window_size: int | None = field(default=None, metadata={"ge": 1})
    attn_types: tuple[AttnType, ...] | None = None
    # The rope base of local layers, which then rotate by plain rope (rope_type applies to global layers only:
    # Gemma 3, OLMo 3); None: local layers rotate as global ones.
    rotary_base_local: float | None = field(default=None, metadata={"gt": 0})
    # Output norms (RMS, with weights, ln1_post / ln2_post) on the attention and MLP outputs before the residual add
    # (Gemma 2/3's sandwich, OLMo 2/3); pre_norms False: no ln1 / ln2, attention and MLP read the raw stream (OLMo).
    post_norms: bool = False
    pre_norms: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.attn_types, list):  # from JSON
            object.__setattr__(self, "attn_types", tuple(self.attn_types))
        check_fields(self)
        if self.normalization_type not in NORMALIZATION_TYPES:
            raise InvalidInputError(
                f"normalization_type must be one of {NORMALIZATION_TYPES}, got {self.normalization_type!r}"
            )
        if self.positional_embedding_type not in POSITIONAL_TYPES:
            raise InvalidInputError(
                f"positional_embedding_type must be one of {POSITIONAL_TYPES}, got {self.positional_embedding_type!r}"
            )
        if not self.attn_only:
            if not self.d_mlp or self.d_mlp < 1:
                raise InvalidInputError("a model with MLPs (attn_only=false) needs d_mlp >= 1")
            if self.act_fn not in ACT_FNS:
                raise InvalidInputError(f"act_fn must be one of {ACT_FNS}, got {self.act_fn!r}")
        if self.positional_embedding_type == "rotary":
            rd = self.rotary_dim if self.rotary_dim is not None else self.d_head
            if rd < 2 or rd > self.d_head or rd % 2:
                raise InvalidInputError(f"rotary_dim must be even and in [2, d_head={self.d_head}], got {rd}")
        self._check_llama_fields()

    def _check_llama_fields(self) -> None:
        """Cross-field rules of the Llama-family fields (types and bounds are checked by check_fields)."""
        self._check_attention_variants()
        if self.n_key_value_heads is not None and self.n_heads % self.n_key_value_heads:
            raise InvalidInputError(f"n_key_value_heads={self.n_key_value_heads} must divide n_heads={self.n_heads}")
        if self.gated_mlp and self.attn_only:
            raise InvalidInputError("gated_mlp=true needs MLPs (attn_only=false, d_mlp >= 1)")
        if self.rope_type == "default" and self.rope_factor != 1.0:
            raise InvalidInputError(
                f"rope_factor={self.rope_factor} but rope_type is 'default': name the scaling type (linear or llama3)"
            )
        if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise InvalidInputError("llama3 rope scaling needs rope_high_freq_factor > rope_low_freq_factor")
        if self.num_experts is not None:
            if not self.gated_mlp or not self.uses_rms:
                raise InvalidInputError("a mixture-of-experts MLP needs gated_mlp=true and RMS normalisation")
            if self.experts_per_token > self.num_experts:
                raise InvalidInputError(
                    f"experts_per_token={self.experts_per_token} exceeds num_experts={self.num_experts}"
                )
        elif self.clamped_swiglu:
            raise InvalidInputError("clamped_swiglu is an expert activation: it needs num_experts")
        self._check_deepseek_fields()
        if self.alibi is not None and self.positional_embedding_type != "none":
            raise InvalidInputError("alibi models have no other positions: positional_embedding_type must be 'none'")

    def _check_deepseek_fields(self) -> None:
        """Cross-field rules of DeepSeek's mixture of experts and multi-head latent attention."""
        deepseek_moe = (
            self.moe_scoring != "softmax" or self.moe_n_groups is not None or self.moe_shared_d_mlp is not None
            or self.moe_dense_layers or self.moe_routed_scale != 1.0
        )  # fmt: skip
        if deepseek_moe and self.num_experts is None:
            raise InvalidInputError("moe_* routing fields need a mixture of experts (num_experts)")
        if (self.moe_n_groups is None) != (self.moe_topk_groups is None):
            raise InvalidInputError("group-limited routing needs both moe_n_groups and moe_topk_groups")
        if self.moe_n_groups is not None and self.num_experts is not None:
            assert self.moe_topk_groups is not None
            if self.num_experts % self.moe_n_groups or self.moe_topk_groups > self.moe_n_groups:
                raise InvalidInputError(
                    f"moe_n_groups={self.moe_n_groups} must divide num_experts={self.num_experts} and be >= "
                    f"moe_topk_groups={self.moe_topk_groups}"
                )
        if (
            self.moe_scoring == "sigmoid"
            and self.moe_n_groups is not None
            and self.num_experts is not None
            and self.num_experts // self.moe_n_groups < 2
        ):
            raise InvalidInputError("sigmoid routing ranks each group by its best two experts: a group needs two")
        if self.moe_dense_layers and self.d_mlp_dense is None:
            raise InvalidInputError("moe_dense_layers needs d_mlp_dense (the width of the dense layers)")
        if self.mla_kv_rank is None:
            if self.mla_q_rank is not None or self.mla_d_nope or self.mla_d_v:
                raise InvalidInputError("mla_* fields need multi-head latent attention (mla_kv_rank)")
            return
        rd = self.rotary_dim or 0
        if self.positional_embedding_type != "rotary" or not self.uses_rms or self.mla_d_v < 1:
            raise InvalidInputError("multi-head latent attention needs rotary positions, RMS norms and mla_d_v >= 1")
        if self.d_head != max(self.mla_d_nope + rd, self.mla_d_v):
            raise InvalidInputError(
                f"d_head={self.d_head} must be max(mla_d_nope + rotary_dim, mla_d_v) = "
                f"{max(self.mla_d_nope + rd, self.mla_d_v)} under multi-head latent attention"
            )
        if self.n_key_value_heads is not None or self.use_bias or self.qk_norm or self.attn_sinks or self.alibi:
            raise InvalidInputError(
                "multi-head latent attention shares one key/value latent: no n_key_value_heads, biases, QK-norm, "
                "sinks or ALiBi"
            )

    def layer_has_experts(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (DeepSeek's first moe_dense_layers are dense)."""
        return self.num_experts is not None and layer >= self.moe_dense_layers

    def layer_d_mlp(self, layer: int) -> int | None:
        """The width of layer `layer`'s dense MLP (d_mlp_dense on DeepSeek's dense layers of an MoE model)."""
        return self.d_mlp_dense if self.num_experts is not None and layer < self.moe_dense_layers else self.d_mlp

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3: latent_attention.py)."""
        return self.mla_kv_rank is not None

    def _check_attention_variants(self) -> None:
        """Cross-field rules of the newest attention's fields (QK-norm, windows, local rope, output norms)."""
        if self.attn_types is not None:
            if len(self.attn_types) != self.n_layers:
                raise InvalidInputError(
                    f"attn_types names {len(self.attn_types)} layers, the model has {self.n_layers}"
                )
            bad = [t for t in self.attn_types if t not in ("global", "local")]
            if bad:
                raise InvalidInputError(f"attn_types entries must be 'global' or 'local', got {show_value(bad[0])}")
            if "local" in self.attn_types and self.window_size is None:
                raise InvalidInputError("attn_types has local layers but window_size is not set")
        if self.rotary_base_local is not None and self.positional_embedding_type != "rotary":
            raise InvalidInputError("rotary_base_local needs rotary positions")
        if (self.post_norms or not self.pre_norms or self.qk_norm) and not self.uses_rms:
            raise InvalidInputError("output norms, QK-norm and models without input norms are RMSNorm models here")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer (keys with i - j < window), None on a global layer."""
        if self.window_size is None:
            return None
        return self.window_size if self.attn_types is None or self.attn_types[layer] == "local" else None

    def layer_rope(self, layer: int) -> ModelConfig:
        """This config as seen by layer `layer`'s rotation: a local layer with rotary_base_local set rotates by plain
        rope at that base (rope.py reads rotary_base and the rope_* fields)."""
        if self.rotary_base_local is None or self.layer_window(layer) is None:
            return self
        return _local_rope(self)

    @property
    def scale(self) -> float:
        """The divisor applied to q.k (TransformerLens `attn_scale`)."""
        return float(self.attn_scale) if self.attn_scale is not None else math.sqrt(self.d_head)

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads per layer (n_heads without grouped-query attention)."""
        return self.n_key_value_heads if self.n_key_value_heads is not None else self.n_heads

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: query head h reads key/value head h // group_size."""
        return self.n_heads // self.n_kv_heads

    @property
    def uses_rms(self) -> bool:
        """RMSNorm ("RMS", "RMSPre"): normalises without centring, so nothing is centred downstream."""
        return self.normalization_type in ("RMS", "RMSPre")

    @property
    def head_names(self) -> list[str]:
        return [head_name(layer, h) for layer in range(self.n_layers) for h in range(self.n_heads)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict with TransformerLens field names; unknown fields are ignored."""
        if not isinstance(data, Mapping):
            raise InvalidInputError(f"a config is a JSON object of fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "attn_only" not in data and data.get("d_mlp"):
            kwargs["attn_only"] = False
        if kwargs.get("positional_embedding_type") is None and "positional_embedding_type" in kwargs:
            kwargs["positional_embedding_type"] = "none"
        missing = [f.name for f in dataclasses.fields(cls) if _required(f) and f.name not in kwargs]
        if missing:
            raise InvalidInputError(f"config is missing required fields: {', '.join(missing)}")
        return cls(**kwargs)


@functools.lru_cache(maxsize=64)
def _local_rope(cfg: ModelConfig) -> ModelConfig:
    assert cfg.rotary_base_local is not None
    return dataclasses.replace(cfg, rotary_base=cfg.rotary_base_local, rope_type="default", rope_factor=1.0)


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
