"""User input -> token ids: single tokens, prompts, id lists; and token ids -> readable TokenRefs.

Token parameters accept an id (`"464"`) or a single-token string (`" the"`, or the vocabulary entry
`"Ġthe"`); a numeral meant as text is given in double quotes (`"\\"5\\""`). Prompts are text, tokenised with
the model's tokenizer with BOS prepended, or a comma-separated id list (`"50256,464,3290"`, taken as is).
Every refusal is an InvalidInputError / LimitExceededError (HTTP 422) saying what was expected: an id is
ASCII digits only (`²`, `①` or `--1` are not ids but text, looked up as a single token) of at most
MAX_ID_DIGITS digits, and a single-token string is at most MAX_TOKEN_CHARS characters.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Literal, TypedDict

from app.schemas import ModelRef, TokenRef
from app.settings import Limits
from app.store import code_version
from circuits_core.circuits.qk_forms import QK_FORMS, qk_form
from circuits_core.errors import InvalidInputError, LimitExceededError, NotFoundError, QkovError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import parse_head

ID_RE = re.compile(r"[+-]?[0-9]+", re.ASCII)
MAX_ID_DIGITS = 12  # no vocabulary has 10^12 tokens; longer numerals are refused before int() sees them
MAX_TOKEN_CHARS = 200  # a single token's text is far shorter


def _token_id(text: str) -> int | None:
    """The integer a token-id string spells (ASCII digits, optional sign), None if it is not one."""
    if ID_RE.fullmatch(text) is None:
        return None
    if len(text.lstrip("+-")) > MAX_ID_DIGITS:
        raise InvalidInputError(
            f"token id {text[:20]}... has {len(text.lstrip('+-'))} digits: not a vocabulary id (at most "
            f"{MAX_ID_DIGITS} digits)"
        )
    return int(text)


def model_ref(loaded: LoadedModel) -> ModelRef:
    """The model and the provenance of every answer computed on it."""
    model = loaded.model
    param = next(model.parameters(), None)
    device = str(param.device) if param is not None else "cpu"
    dtype = str(model.dtype).removeprefix("torch.")
    switches = {k: v for k, v in (getattr(model, "processing", None) or {}).items() if isinstance(v, bool)}
    return ModelRef(
        id=loaded.path.name,
        digest=str(loaded.digest),
        qkov_version=qkov_version(),
        processing=switches,
        numbers=f"weights read from the {loaded.format} checkpoint as {dtype}, computed in {dtype} on {device}; "
        "JSON numbers are the shortest decimal that reads back as the same float64 (NaN and infinities as null)",
        device=device,
        dtype=dtype,
    )


@functools.cache
def qkov_version() -> str:
    """The package version and the digest of the code that computes and renders answers (app/store.code_version)."""
    try:
        release = importlib.metadata.version("qkov")
    except importlib.metadata.PackageNotFoundError:
        release = "unreleased"
    return f"{release}+{code_version()}"


def token_text(loaded: LoadedModel, token_id: int) -> str:
    """Readable text of a token; `<id>` where the tokenizer does not cover the id (padded vocabularies)."""
    tok = loaded.tokenizer
    if tok is None or not 0 <= token_id < tok.vocab_size:
        return f"<{token_id}>"
    return str(tok.token_str(token_id))


def token_ref(loaded: LoadedModel, token_id: int) -> TokenRef:
    return TokenRef(id=int(token_id), text=token_text(loaded, int(token_id)))


def token_refs(loaded: LoadedModel, ids: list[int]) -> list[TokenRef]:
    """Consecutive tokens (a prompt): a character split over byte-level tokens ('é' = 0xC3 + 0xA9) is shown
    whole on the token that completes it (Tokenizer.token_strs); independent tokens go through `token_ref`."""
    tok = loaded.tokenizer
    ids = [int(i) for i in ids]
    if tok is None or not all(0 <= i < tok.vocab_size for i in ids):
        return [token_ref(loaded, i) for i in ids]
    return [TokenRef(id=i, text=text) for i, text in zip(ids, tok.token_strs(ids), strict=True)]


def check_token_id(loaded: LoadedModel, token_id: int) -> int:
    d_vocab = loaded.model.cfg.d_vocab
    if not 0 <= token_id < d_vocab:
        raise InvalidInputError(f"token id {token_id} is not in the vocabulary: ids run from 0 to {d_vocab - 1}")
    return token_id


def resolve_token(loaded: LoadedModel, token: str | int) -> int:
    """One token id from an id or a single-token string; 422 for a multi-token string or an unknown id."""
    if isinstance(token, int) and not isinstance(token, bool):
        return check_token_id(loaded, token)
    text = str(token)
    token_id = _token_id(text.strip())
    if token_id is not None:
        return check_token_id(loaded, token_id)
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1]
    if text == "":
        raise InvalidInputError("empty token: give a token id or a single-token string")
    if len(text) > MAX_TOKEN_CHARS:
        raise InvalidInputError(f"a single token is at most {MAX_TOKEN_CHARS} characters; this one has {len(text)}")
    if loaded.tokenizer is None:
        raise InvalidInputError(f"model {loaded.path.name!r} has no tokenizer: give the token as an id, not {text!r}")
    try:
        return check_token_id(loaded, int(loaded.tokenizer.lookup(text)))
    except NotFoundError as exc:  # multi-token or unknown string: a bad argument, not a missing resource
        raise InvalidInputError(str(exc)) from exc


def spelling_variants(loaded: LoadedModel, token: str | None) -> tuple[tuple[str, int], list[tuple[str, int]]] | None:
    """For a token given as text: (the token it resolved to (text, id), the other single tokens that differ from it
    only by a leading space). 'Paris' and ' Paris' are different tokens; a page says which it used and offers the
    other. None for an id, an unresolvable string or a model without a tokenizer."""
    if token is None or _token_id(token.strip()) is not None or loaded.tokenizer is None:
        return None
    try:
        chosen = resolve_token(loaded, token)
    except QkovError:
        return None
    text = token[1:-1] if len(token) >= 2 and token[0] == token[-1] == '"' else token
    bare = text.lstrip(" ")
    others = []
    for variant in dict.fromkeys((bare, " " + bare)):
        if variant == text or not variant:
            continue
        try:
            others.append((variant, resolve_token(loaded, variant)))
        except QkovError:
            continue
    return (text, chosen), [(v, i) for v, i in others if i != chosen]


def parse_token_ids(text: str) -> list[int]:
    """`"1, 2,3"` -> [1, 2, 3]."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise InvalidInputError("tokens is empty: give comma-separated token ids, e.g. tokens=0,15,27")
    bad = [p for p in parts if ID_RE.fullmatch(p) is None]
    if bad:
        raise InvalidInputError(f"tokens must be comma-separated integer ids; not an id: {bad[0][:40]!r}")
    return [int(i) for i in map(_token_id, parts) if i is not None]


def max_prompt_tokens(loaded: LoadedModel, limits: Limits) -> int:
    return min(loaded.model.cfg.n_ctx, limits.max_prompt_tokens)


def resolve_prompt(loaded: LoadedModel, prompt: str | None, tokens: str | None, limits: Limits) -> list[int]:
    """Token ids of a prompt (text with BOS prepended, or an id list), checked against vocab and length."""
    if (prompt is None) == (tokens is None):
        raise InvalidInputError("give exactly one of prompt (text) or tokens (comma-separated ids)")
    if prompt is not None:
        if prompt == "":
            raise InvalidInputError("the prompt is empty: give some text")
        if loaded.tokenizer is None:
            raise InvalidInputError(f"model {loaded.path.name!r} has no tokenizer: give the prompt as tokens=<ids>")
        bos = loaded.tokenizer.bos_token_id is not None
        ids = [int(i) for i in loaded.tokenizer.encode(prompt, prepend_bos=bos)]
    else:
        assert tokens is not None
        ids = parse_token_ids(tokens)
    for i in ids:
        check_token_id(loaded, i)
    cap = max_prompt_tokens(loaded, limits)
    if len(ids) > cap:
        raise LimitExceededError(
            f"the prompt is {len(ids)} tokens long; at most {cap} are allowed "
            f"(min of the model's context n_ctx={loaded.model.cfg.n_ctx} and "
            f"max_prompt_tokens={limits.max_prompt_tokens})"
        )
    return ids


def check_k(k: int, limits: Limits, available: int) -> int:
    """k within [1, max_k]; more than the entries available is clipped to them."""
    if k < 1:
        raise InvalidInputError(f"k must be at least 1, got {k}")
    if k > limits.max_k:
        raise LimitExceededError(f"k={k} is over the limit of {limits.max_k}")
    return min(k, available)


class QKFormFields(TypedDict):
    """The fields of app/schemas/common.QKFormed."""

    qk_form: str
    qk_form_note: str


def qk_form_fields(loaded: LoadedModel, level: Literal["token", "weight", "prompt"]) -> QKFormFields:
    """{"qk_form", "qk_form_note"}: the form of the QK numbers a view at this level shows on this model, and that
    form in words (qk_forms.QK_FORMS)."""
    form = qk_form(loaded.model, level)
    return {"qk_form": form, "qk_form_note": QK_FORMS[form]}


def parse_heads(names: list[str], loaded: LoadedModel, max_heads: int) -> list[tuple[int, int]]:
    """Head names -> (layer, head), checked, at most max_heads."""
    if len(names) > max_heads:
        raise LimitExceededError(f"{len(names)} heads requested; at most {max_heads} per request")
    if not names:
        raise InvalidInputError("no heads given: name heads as L{layer}H{head}, comma-separated")
    return [parse_head(n, loaded.model.cfg) for n in names]
