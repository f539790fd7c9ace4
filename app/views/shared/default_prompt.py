"""The prompt an analysis reads when the request gives neither prompt nor tokens: the model card's `sample_text`
(held-out text shipped with the model) when present, else BUILTIN_TEXT, a short Python snippet (the toy models
learn code); cut to the longest prompt the limits allow."""

from __future__ import annotations

from app.params import PromptInput
from app.settings import Limits
from app.views.shared.inputs import max_prompt_tokens, resolve_prompt
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel

BUILTIN_TEXT = (
    "class Stack(object):\n"
    "    def __init__(self):\n"
    "        self.items = []\n\n"
    "    def push(self, item):\n"
    "        self.items.append(item)\n\n"
    "    def pop(self):\n"
    "        return self.items.pop()\n"
)


def default_text(loaded: LoadedModel) -> tuple[str, str]:
    """(text, where it came from): the card's held-out sample, else the built-in snippet."""
    card = loaded.card if isinstance(loaded.card, dict) else {}
    sample = card.get("sample_text")
    return (sample, "card") if isinstance(sample, str) and sample else (BUILTIN_TEXT, "builtin")


def _default_ids(loaded: LoadedModel, limits: Limits) -> tuple[list[int], str]:
    if loaded.tokenizer is None:
        raise InvalidInputError(f"model {loaded.path.name!r} has no tokenizer: give the text as tokens=<ids>")
    text, source = default_text(loaded)
    bos = loaded.tokenizer.bos_token_id is not None
    ids = [int(i) for i in loaded.tokenizer.encode(text, prepend_bos=bos)]
    return ids[: max_prompt_tokens(loaded, limits)], source


def prompt_or_default(loaded: LoadedModel, p: PromptInput, limits: Limits) -> tuple[list[int], str]:
    """(token ids, where they came from): the prompt or token ids given, else the default text (card or builtin)."""
    if p.prompt is None and p.tokens is None:
        return _default_ids(loaded, limits)
    return resolve_prompt(loaded, p.prompt, p.tokens, limits), "prompt" if p.prompt is not None else "tokens"
