"""Shared pieces of the JSON answers: tokens, scored tokens, matrix entries, complex numbers."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TokenRef(BaseModel):
    """A vocabulary entry: its id (row of W_E, column of W_U) and its readable text."""

    id: int = Field(description="token id")
    text: str = Field(description="readable text of the token (' the', '\\n')")


class ScoredToken(BaseModel):
    token: TokenRef
    value: float


class MatrixEntry(BaseModel):
    """One entry of a [d_vocab, d_vocab] circuit: rows and columns are tokens."""

    row: TokenRef
    col: TokenRef
    value: float
    prob: float | None = Field(
        default=None, description="direct path only: softmax of the row (+ b_U), the model's P(col | row)"
    )
    corpus_prob: float | None = Field(
        default=None,
        description="direct path only: P(col | row) in the held-out corpus, when the model has one (None: row unseen)",
    )
    corpus_count: int | None = Field(
        default=None, description="direct path only: held-out count of the bigram (row, col)"
    )


class Complex(BaseModel):
    re: float
    im: float


class QKFormed(BaseModel):
    """An answer whose numbers are QK numbers: the form they are in (circuits_core/circuits/qk_forms.py, docs/maths.md
    §7.1), filled by app/views/shared/inputs.qk_form_fields."""

    qk_form: str | None = Field(
        default=None,
        description="the form of the QK numbers (qk_forms.QK_FORMS): 'exact' without QK-norm; under QK-norm 'cosine' "
        "(token level: each token's own scale, exact), 'bilinear' (weight level: W_Q Γ_q R Γ_k W_Kᵀ, per-token scales "
        "left out) or 'frozen-norm' (prompt level: the run's scales frozen); the latent forms under multi-head latent "
        "attention",
    )
    qk_form_note: str | None = Field(default=None, description="that form in words")


class ModelRef(BaseModel):
    """Which model answered, the checkpoint digest the numbers come from, and how they were computed (provenance)."""

    id: str
    digest: str
    qkov_version: str | None = Field(default=None, description="qkov's version and the digest of its code")
    processing: dict[str, bool] | None = Field(
        default=None, description="the processing switches applied at load (fold_ln, centring, ...)"
    )
    numbers: str | None = Field(default=None, description="the form of the numbers: weights, compute dtype, JSON")
    device: str | None = Field(default=None, description="where the model's parameters live (cpu, cuda:0, ...)")
    dtype: str | None = Field(default=None, description="the compute dtype of the model's parameters")
