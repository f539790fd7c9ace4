"""Per-head scores (the heads table) and the one-head summary."""

from __future__ import annotations

from pydantic import BaseModel, Field

from app.schemas.common import Complex, ModelRef, QKFormed
from app.schemas.rotary import ReferenceText


class DetectorInput(BaseModel):
    """The standard input of the behavioural detectors: BOS + r + r, r uniform random tokens."""

    kind: str = Field(description="'repeated_random' or 'prompt'")
    seq_len: int | None = Field(default=None, description="length of each random segment r")
    batch: int
    seed: int | None
    bos: int | None = Field(default=None, description="BOS token id prepended (None: no BOS)")
    n_tokens: int = Field(description="tokens per sequence")


class HeadScores(BaseModel):
    """Every score of one head: weight-based copying scores and behavioural detector scores."""

    head: str = Field(description="L{layer}H{head}")
    layer: int
    index: int = Field(description="head index inside its layer")
    ov_copying: float | None = Field(description="sum(eig)/sum(|eig|) of the full OV circuit W_E W_OV W_U, in [-1, 1]")
    qk_copying: float | None = Field(description="sum(eig)/sum(|eig|) of the token-token QK circuit W_E W_QK W_E^T")
    previous_token: float | None
    current_token: float | None
    first_token: float | None
    duplicate_token: float | None
    induction: float | None
    qk_k_composition: float | None = Field(
        default=None,
        description="positivity sum(eig)/sum(|eig|) of the K-composition token circuit with the previous-token "
        "head (the paper's 2-D induction view, y axis; 0 in layer 0)",
    )
    qk_k_composition_weighted: float | None = Field(
        default=None,
        description="the same with every earlier head weighted by its previous-token score (Olsson et al.)",
    )
    kernel_peak_offset: int | None = Field(
        default=None,
        description="rotary models: the offset δ in 0..64 where the positional kernel μ Ω(δ) μᵀ / √d_head "
        "peaks (μ: mean normalised residual on the reference text, see .../heads/{head}/positional; under QK-norm the "
        "kernel is in the cosine form, with μ's own scales); None otherwise",
    )


class HeadsView(QKFormed):
    """The heads table; `qk_form` is the form of its weight-level QK columns (qk_copying, qk_k_composition)."""

    model: ModelRef
    detector_input: DetectorInput
    heads: list[HeadScores]
    previous_token_head: str | None = Field(
        default=None,
        description="the heads that matter (heads_rule): the strongest previous-token head of a layer below "
        "induction_head; every head's qk_k_composition is measured against it",
    )
    induction_head: str | None = Field(
        default=None, description="the heads that matter (heads_rule): the strongest induction head of layers >= 1"
    )
    loss_first_copy: float | None = Field(
        default=None, description="mean next-token loss (nats) on the first copy of r in the detector input BOS + r + r"
    )
    loss_second_copy: float | None = Field(
        default=None, description="the same on the second copy: lower when the model predicts it from the first"
    )
    loss_by_position: list[float] | None = Field(
        default=None,
        description="mean next-token loss at each position of the detector input (column i predicts token i + 1)",
    )
    heads_rule: str | None = Field(
        default=None, description="how previous_token_head and induction_head are chosen (every page's default heads)"
    )
    kernel_reference: ReferenceText | None = Field(
        default=None, description="rotary models: the text μ of the kernel peak offsets was measured on; None otherwise"
    )


class CopyingMetricsView(BaseModel):
    """The paper's alternative copying metrics of one head's full OV circuit M [V, V] (rows = source token)."""

    model: ModelRef
    head: str
    ov_copying: float | None = Field(description="eigenvalue copying score sum(eig)/sum(|eig|)")
    diagonal_positive: float = Field(description="fraction of tokens a with M[a, a] > 0")
    diagonal_quantiles: list[float] = Field(description="quantiles 0, .25, .5, .75, 1 of the diagonal")
    top1: float = Field(description="fraction of tokens whose own logit is the largest of their row")
    topk: float = Field(description="fraction of tokens among the k largest of their row")
    k: int
    n_tokens: int = Field(description="the tokens the circuit's rows and columns range over")
    token_set: str | None = Field(default=None, description="which tokens, in words (None: every token)")


class PositionalQK(BaseModel):
    """softmax(mask(W_pos W_QK W_pos^T / s)) over the first n positions: the head's purely positional pattern."""

    n_positions: int
    pattern: list[list[float]] = Field(description="[query][key], causal (zeros above the diagonal)")
    previous_token: float = Field(description="mean of the sub-diagonal: attention to the previous position")
    current_token: float = Field(description="mean of the diagonal")


class HeadView(QKFormed):
    """One head's scores and spectra; `qk_form` is the form of its weight-level QK numbers (its row's QK columns, the QK
    eigenvalues and singular values)."""

    model: ModelRef
    head: str
    layer: int
    index: int
    scores: HeadScores
    ov_eigenvalues: list[Complex] = Field(
        description="the d_head eigenvalues of W_O W_U W_E W_V (nonzero spectrum of the full OV circuit)"
    )
    qk_eigenvalues: list[Complex] = Field(
        description="the d_head eigenvalues of W_K^T W_E^T W_E W_Q (token-token QK circuit)"
    )
    ov_singular_values: list[float] = Field(description="singular values of the residual-space W_OV = W_V W_O")
    qk_singular_values: list[float] = Field(description="singular values of the residual-space W_QK = W_Q W_K^T")
    positional: PositionalQK | None = Field(default=None, description="absent when the model has no learned positions")
    latent: dict[str, float | int] | None = Field(
        default=None,
        description="multi-head latent attention only (circuits/latent_circuits.term_norms): Frobenius norms of the "
        "content term A_h, of the rotary term's sides C_h and D (D shared by the layer's heads) and of OV_h, with the "
        "rank bounds of each and the key/value latent's rank",
    )
