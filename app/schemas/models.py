"""Model listing and model summary."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from app.schemas.common import ModelRef, TokenRef


class DefaultedValue(BaseModel):
    field: str = Field(description="the config field (ModelConfig's name)")
    value: str = Field(description="the value used")
    source: str = Field(description="where the value comes from (the reference implementations that assume it)")


class ModelSummary(BaseModel):
    id: str = Field(description="folder name of the checkpoint")
    format: str = Field(description="checkpoint format (qkov, transformer_lens, hf_gpt2, ...)")
    shipped: bool = Field(description="one of qkov's own toy models")
    digest: str = Field(description="checkpoint digest (cache key)")
    n_layers: int
    n_heads: int
    d_model: int
    d_head: int
    d_vocab: int
    n_ctx: int
    d_mlp: int | None
    attn_only: bool
    positional_embedding_type: str
    normalization_type: str | None
    act_fn: str | None
    use_bias: bool
    processing: dict[str, Any] = Field(description="weight-processing switches applied at load (LN folding, centring)")
    has_tokenizer: bool
    bos_token_id: int | None
    heads: list[str] = Field(description="head names L{layer}H{head}")
    card: dict[str, Any] | None = Field(default=None, description="model card: measured facts about the checkpoint")
    defaulted: list[DefaultedValue] = Field(
        default_factory=list,
        description="config values the checkpoint file does not carry, taken from a per-architecture default",
    )
    exactness: list[str] = Field(
        default_factory=list,
        description="what is exact and what is frozen in this model's circuits, one sentence per feature of its "
        "attention that the paper's picture lacks (QK-norm, soft caps, sliding windows, output norms; "
        "docs/maths.md §7); empty when it has none",
    )
    nonfinite_weights: list[str] = Field(
        default_factory=list,
        description="stored tensors holding NaN or inf (with counts); analyses that cannot run on them are refused",
    )
    computed_on: dict[str, str] = Field(
        default_factory=dict,
        description="device, weights' dtype, compute dtype and whether the MLP weights are read yet "
        "(LoadedModel.provenance)",
    )


class UnavailableModel(BaseModel):
    id: str
    format: str
    state: Literal["failed", "loading"] = Field(
        default="failed",
        description="failed: the checkpoint cannot be loaded; loading: its load has not finished within the "
        "listing's wait (it goes on; ask again)",
    )
    detail: str = Field(description="why the checkpoint cannot be loaded (file and problem), or that it is loading")


class ModelListView(BaseModel):
    models: list[ModelSummary]
    unavailable: list[UnavailableModel] = Field(
        default_factory=list, description="folders that failed to load, or are still loading"
    )


class TokenizeView(BaseModel):
    model: ModelRef
    prompt: str | None
    tokens: list[TokenRef] = Field(description="the tokens in order, BOS first")
    n_tokens: int
