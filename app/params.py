"""The typed parameters of every analysis (pydantic), and the field types they share.

A field is a query parameter of the same name (a path parameter where the analysis's path names it). Bounds
that come from the server's limits are marked `Limit(...)` and applied per app (app/analysis.py `bounded`),
so they appear in the OpenAPI schema; head fields are marked `HeadField` / `HeadsField` and normalised to
L{layer}H{head} before the cache key, the builder and the JSON link see them.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Self

from pydantic import Field

from app.analysis import AnalysisParams, HeadField, HeadsField, Limit, split_heads
from circuits_core.errors import InvalidInputError, NotFoundError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.config import ModelConfig
from circuits_core.model.head_names import all_heads, head_name, parse_head
from circuits_core.prompt.detectors import STANDARD_BATCH, STANDARD_SEQ_LEN

TOKEN_DOC = (
    "a token id (e.g. 464) or a single-token string (e.g. ' the'); a numeral meant as text goes in double quotes"
)
HEAD_DOC = "head name L{layer}H{head}, e.g. L1H4"

# -- shared field types --------------------------------------------------------------------------------------
Token = Annotated[str | None, Field(max_length=256, description=TOKEN_DOC)]
K = Annotated[int, Field(ge=1, description="how many entries"), Limit("max_k")]
MinCount = Annotated[
    int | None,
    Field(
        ge=1,
        le=10**9,
        description="frequent tokens only: keep tokens seen at least this often in training (the model folder's "
        "token_counts.npy; 422 for a model without it). Without it every token is ranked",
    ),
]
Prompt = Annotated[
    str | None,
    Field(
        description="text, tokenised with the model's tokenizer, BOS prepended (at most min(n_ctx, "
        "{max_prompt_tokens}) tokens)"
    ),
    Limit("max_prompt_tokens", "max_length", 64),
]
Tokens = Annotated[
    str | None,
    Field(description="comma-separated token ids, used as given (instead of prompt; at most {max_prompt_tokens})"),
    Limit("max_prompt_tokens", "max_length", 64),
]
Heads = Annotated[
    str | None,
    Field(description="comma-separated head names L{layer}H{head}, at most {max_heads}"),
    Limit("max_heads", "max_length", 12),
    HeadsField(),
]
Head = Annotated[str, Field(max_length=16, description=HEAD_DOC), HeadField()]
Offset = Annotated[
    int,
    Field(
        ge=0,
        le=1_000_000,
        description=(
            "query-key offset δ = i - j of a rotary model: its QK circuit there is W_Q R(δ) W_Kᵀ (0: TransformerLens's "
            "QK); below n_ctx; other models take 0 only"
        ),
    ),
]
BasisChoice = Annotated[
    Literal["served", "raw"],
    Field(
        description=(
            "which weights: 'served' (processed as the model is served: folded LayerNorm, centred unembedding, as the "
            "view's `basis` says) or 'raw' (the checkpoint as stored, loaded once more without processing)"
        )
    ),
]
DEFAULT_ALL_HEADS = 64  # term importance ablates every head by default up to this many
DEFAULT_VOCAB = 8192  # larger vocabularies: the global tables rank this many tokens unless vocab=all
Vocab = Annotated[
    Literal["default", "all"],
    Field(
        description=(
            f"which tokens a global table (no token given) and the default skip-trigram source rank: 'default' -- "
            f"every token "
            f"of a vocabulary up to {DEFAULT_VOCAB:,} tokens; of a larger one, its {DEFAULT_VOCAB:,} most frequent "
            f"tokens (the "
            f"folder's token_counts.npy) or else its {DEFAULT_VOCAB:,} lowest ids (the answer's `token_set` says "
            f"which); 'all' -- "
            "every token (on a 50,257-token vocabulary about 38x the entries). min_count, when given, chooses the "
            "tokens instead"
        )
    ),
]
Seed = Annotated[int, Field(ge=0, le=2**31 - 1, description="seed of the random tokens")]
Batch = Annotated[int, Field(ge=1, description="number of random sequences"), Limit("max_batch")]
MaxOrder = Annotated[
    int,
    Field(ge=0, description="highest path order listed explicitly; the rest is the remainder term"),
    Limit("max_order"),
]
Position = Annotated[
    int | None,
    Field(description="destination position (default: the last; negative counts from the end)"),
    Limit("max_prompt_tokens", "lt"),
    Limit("max_prompt_tokens", "ge", -1),
]


def target_token(what: str) -> object:
    return Field(default=None, max_length=256, description=f"{what}: {TOKEN_DOC}")


# -- models, heads and their circuits ------------------------------------------------------------------------
class NoParams(AnalysisParams):
    """An analysis without parameters."""


class TourParams(AnalysisParams):
    chapter: Annotated[
        Literal["paper", "smollm2", "gemma3"],
        Field(
            description="'paper': the paper's figures on the shipped toy models (and the residual stream as a "
            "channel); 'smollm2': the rotary/GQA chapter on the real SmolLM2-135M (make smollm2); 'gemma3': sliding "
            "windows and QK-norm on the real Gemma-3 270M (make gemma3)"
        ),
    ] = "paper"


class PromptInput(AnalysisParams):
    """A prompt as text or as token ids."""

    prompt: Prompt = None
    tokens: Tokens = None


class HeadParams(AnalysisParams):
    head: Head


class CopyingParams(HeadParams):
    k: K = 5
    vocab: Vocab = "default"


class DirectParams(AnalysisParams):
    """A token circuit's row (or column) for a token, else its global top-k."""

    token: Token = None
    k: K = 20
    basis: BasisChoice = "served"
    min_count: MinCount = None
    vocab: Vocab = "default"


class OVParams(DirectParams):
    head: Head


class QKParams(OVParams):
    side: Annotated[
        Literal["query", "key"], Field(description="whether token is the query (its row) or the key (its column)")
    ] = "query"
    offset: Offset = 0


class SkipTrigramParams(OVParams):
    k: K = 10
    offset: Offset = 0


class DetectorParams(PromptInput):
    seq_len: Annotated[
        int | None,
        Field(
            ge=1,
            description=f"length T of the random segment r in BOS + r + r (default: "
            f"the standard {STANDARD_SEQ_LEN}, shortened to fit the model's n_ctx)",
        ),
        Limit("max_seq_len"),
    ] = None
    batch: Batch = STANDARD_BATCH
    seed: Seed = 0
    heads: Heads = None

    def normalised(self, loaded: LoadedModel) -> Self:
        """seq_len None: the standard input, shortened to fit the context (BOS + r + r <= n_ctx) and this server's
        max_seq_len (the bound `bounded` put on the field)."""
        done = super().normalised(loaded)
        if self.seq_len is not None:
            return done
        bounds = [m.le for m in type(self).model_fields["seq_len"].metadata if getattr(m, "le", None) is not None]
        fitted = min(STANDARD_SEQ_LEN, (loaded.model.cfg.n_ctx - 1) // 2, *bounds)
        return done.model_copy(update={"seq_len": max(1, fitted)})


# -- composition, prompts, paths -----------------------------------------------------------------------------
class CompositionParams(AnalysisParams):
    kind: Annotated[Literal["Q", "K", "V"], Field(description="Q, K or V composition (docs/maths.md §2.9)")] = "K"
    offset: Offset = 0
    basis: BasisChoice = "served"


class CompositionPairParams(AnalysisParams):
    source: Annotated[str, Field(max_length=16, description=f"the earlier {HEAD_DOC}"), HeadField()]
    target: Annotated[str, Field(max_length=16, description=f"the later {HEAD_DOC}"), HeadField()]
    k: K = 10
    basis: BasisChoice = "served"
    vocab: Vocab = "default"


class PromptParams(PromptInput):
    heads: Heads = None
    weighted: Annotated[bool, Field(description="value-weighted patterns A[i, j] ||v_j|| (docs/maths.md §2.16)")] = (
        False
    )


class PathsParams(PromptInput):
    position: Position = None
    target: str | None = target_token("the logit to expand (default: the model's top prediction at position)")  # type: ignore[assignment]
    contrast: str | None = target_token("subtract this token's logit (logit difference)")  # type: ignore[assignment]
    max_order: MaxOrder = 2
    by_source: Annotated[bool, Field(description="split each listed term over source positions")] = False
    k: K = 30


class ChainParams(AnalysisParams):
    heads: Annotated[
        str,
        Field(description="comma-separated heads in increasing layers"),
        Limit("max_heads", "max_length", 12),
        HeadsField(),
    ]
    prompt: Prompt = None
    tokens: Tokens = None
    target: str | None = target_token(
        "the logit the contribution is measured on (default: top prediction at the last position)"
    )  # type: ignore[assignment]
    k: K = 20


class QKPathsParams(PromptInput):
    head: Annotated[str, Field(max_length=16, description=f"{HEAD_DOC}, in layer >= 1"), HeadField()]
    k: K = 6
    query: Annotated[
        int | None,
        Field(ge=0, le=1_000_000, description="with key: list the terms of the score at this query position"),
    ] = None
    key: Annotated[int | None, Field(ge=0, le=1_000_000, description="the key position of `query` (at most query)")] = (
        None
    )


AblatedHeads = Annotated[
    str | None,
    Field(
        description=(
            "the heads the head ablations remove, one at a time: 'all', 'none', or comma-separated head names (L3H1) "
            "and "
            "layers (L3: every head of layer 3; L0-L9: of layers 0 to 9). Default: every head on a model of at most "
            f"{DEFAULT_ALL_HEADS} heads; on a larger one the heads its summary names (computed from its heads table "
            "on first use): the heads that matter and every induction or previous-token head. Priced before it runs: "
            "a head of layer l reruns layers l.. twice "
            "(patterns "
            "frozen, then recomputed), so the FLOPs grow with the heads and their depth, against the request deadline"
        )
    ),
    Limit("max_heads", "max_length", 12),
]


class TermImportanceParams(PromptInput):
    """Without a prompt: the built-in text (cached)."""

    heads: AblatedHeads = None

    def normalised(self, loaded: LoadedModel) -> Self:
        """`heads` canonical (L01H2 -> L1H2, l3 -> L3, ALL -> all; '' -> the default), checked against the model."""
        if self.heads is None:
            return self
        text = ",".join(item for item, _ in head_selection(self.heads, loaded.model.cfg)) or None
        return self.model_copy(update={"heads": text})


_LAYERS = re.compile(r"^L(\d+)(?:-L?(\d+))?$", re.IGNORECASE)


def head_selection(text: str, cfg: ModelConfig) -> list[tuple[str, list[tuple[int, int]]]]:
    """The items of a `heads` selection, each canonical with its (layer, head) pairs: 'all', 'none', head names,
    layers 'L3' and layer ranges 'L0-L9' (NotFoundError / InvalidInputError naming a bad item)."""
    items = split_heads(text)
    words = [i.lower() for i in items if i.lower() in ("all", "none")]
    if words and len(items) > 1:
        raise InvalidInputError(f"'{words[0]}' stands alone in heads, got {text!r}")
    if words:
        return [(words[0], all_heads(cfg) if words[0] == "all" else [])]
    out = []
    for item in items:
        match = _LAYERS.match(item)
        if match is None:
            layer, h = parse_head(item, cfg)
            out.append((head_name(layer, h), [(layer, h)]))
            continue
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise InvalidInputError(f"layer range {item!r} runs backwards: write L{last}-L{first}")
        if last >= cfg.n_layers:
            raise NotFoundError(f"layer {last} in {item!r} out of range: the model has {cfg.n_layers} layers")
        name = f"L{first}" if first == last else f"L{first}-L{last}"
        out.append((name, [(layer, h) for layer in range(first, last + 1) for h in range(cfg.n_heads)]))
    return out
