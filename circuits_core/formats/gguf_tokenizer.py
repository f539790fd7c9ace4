"""The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, built with the `tokenizers` library.

Two kinds (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE (SmolLM2, Llama 3, Qwen2, Qwen3): the vocabulary, the merges in rank order, and the
  pre-tokenizer named by `tokenizer.ggml.pre` (PRE_TOKENIZERS), which splits the text into the pieces BPE merges
  within: GPT-2's pattern, GPT-2's with every digit split apart first ("smollm"), or llama.cpp's Llama 3 pattern
  (digits in runs of at most three, letters with one leading non-letter, contractions in either case), Qwen2's
  (the same with every digit alone) or DeepSeek-V3's (three patterns in turn: digits, CJK and kana runs, the rest).
  A vocabulary's merges were learned within its own pieces, so a wrong pattern gives other ids for the same text; a
  name not listed is refused.
- "llama" on the Gemma architectures: SentencePiece's BPE with byte fallback, rebuilt from the vocabulary:
  - spaces become '▁' before BPE (SentencePiece's normalisation; no prefix space is added, as Gemma's
    tokenizer adds none), and the file's user-defined whitespace tokens ('  ', '   ', ...) are spelled with '▁'
    so that BPE can reach them;
  - the file has no merges: every split of an entry into two entries is a merge, ranked by the entry's place in
    the vocabulary (SentencePiece keeps its pieces best-first: the file's scores are those places negated for
    every normal token, and a placeholder -1000 for the control and user-defined ones), then longer left
    piece first; this is how transformers rebuilds the same tokenizer from the same file (sentencepiece_merges.py
    finds them through hashes of the cuts);
  - control tokens (type 3: `<bos>`, `<start_of_turn>`, ...) and user-defined ones (type 4: '\\n', '[multimodal]')
    are matched whole in the text before BPE; byte pieces '<0x00>'..'<0xFF>' (type 6) are the fallback for
    characters outside the vocabulary.
  Gemma's 262,144 entries make 514,906 merges; with the `tokenizers` BPE constructor (about 0.9 CPU-s, holding the
  GIL) the build takes about 2 CPU-seconds: the
  tokenizer is built on a worker thread once the caller sets `start` (load_checkpoint: when the model is built, so
  the build neither takes a core from the load nor stalls its threads on the GIL), and its first use waits for it.
Bounds: the vocabulary, its scores and token types hold at most one entry per row of the embedding, and the merges
at most MERGES_PER_TOKEN per entry (Llama 3 lists 2.2 per entry); larger arrays are refused by name before they are
decoded (gguf_header.GGUFHeader.strings).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from circuits_core.errors import CheckpointError
from circuits_core.formats.gguf_header import GGUFHeader
from circuits_core.formats.sentencepiece_merges import sentencepiece_merges
from circuits_core.formats.tokenizer import SENTENCEPIECE_SPACE, Tokenizer, sentencepiece_bytes
from circuits_core.schedule import later

# llama.cpp's split patterns for byte-level BPE (its `llama-vocab` pre-tokenizer table): Llama 3's, and Qwen2's, which
# differs only in taking every digit alone (\p{N} for \p{N}{1,3})
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# DeepSeek-V3's, three patterns one after another (each splits the pieces of the one before): digits in runs of at most
# three; runs of CJK ideographs (U+4E00-U+9FA5), hiragana and katakana; then one ASCII punctuation mark before ASCII
# letters, letters and marks with one leading character that is no letter, punctuation, symbol or line break,
# punctuation and symbols with an optional leading space, and whitespace as in Llama 3's
DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# GPT-2's pattern (the byte-level pre-tokenizer's own); every digit apart, then GPT-2's pattern
GPT2, DIGITS = "gpt-2", "digits"


def byte_level_pre_tokenizer(split: str | tuple[str, ...]) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a byte-level BPE: GPT2, DIGITS, or split patterns (one, or several applied in turn) whose
    pieces are kept whole."""
    if split == GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split == DIGITS:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    patterns = (split,) if isinstance(split, str) else split
    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in patterns),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> how the text is split before byte-level BPE (the names llama.cpp's converter writes)
PRE_TOKENIZERS: dict[str, str | tuple[str, ...]] = {
    "gpt-2": GPT2, "gpt2": GPT2, "mpt": GPT2, "olmo": GPT2, "jais": GPT2,
    "smollm": DIGITS, "starcoder": DIGITS, "refact": DIGITS, "command-r": DIGITS, "codeshell": DIGITS,
    "exaone": DIGITS, "minerva-7b": DIGITS,
    "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "llama-bpe": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
    "falcon3": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "megrez": QWEN2_SPLIT,
    "deepseek-v3": DEEPSEEK3_SPLITS,
}  # fmt: skip
SENTENCEPIECE_ARCHITECTURES = ("gemma", "gemma2", "gemma3")  # SentencePiece BPE vocabularies read here
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type values
MERGES_PER_TOKEN = 4


def gguf_tokenizer(
    header: GGUFHeader, arch: str, d_vocab: int, bos_token_id: int | None, start: threading.Event | None = None
) -> Tokenizer | None:
    """The tokenizer of the file (None when it has none); CheckpointError naming the tokenizer model or
    pre-tokenizer when it is one this code does not build, or an array larger than the model allows. A SentencePiece
    vocabulary is built on the worker thread once `start` is set (at once without one): the caller must set it, even
    when it fails, or the worker waits for ever."""
    model = header.value("tokenizer.ggml.model")
    if model is None:
        return None
    name = header.name
    tokens = header.strings("tokenizer.ggml.tokens", d_vocab)
    if tokens is None:
        raise CheckpointError(f"{name}: tokenizer.ggml.model is {model!r} but there is no tokenizer.ggml.tokens")
    types = header.numbers("tokenizer.ggml.token_type", d_vocab)
    if types is not None and len(types) != len(tokens):
        raise CheckpointError(f"{name}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    kinds = types if types is not None else np.full(len(tokens), NORMAL)
    if model == "gpt2":
        return _byte_level(header, tokens, kinds, d_vocab, bos_token_id)
    if model == "llama" and arch in SENTENCEPIECE_ARCHITECTURES:
        scores = header.numbers("tokenizer.ggml.scores", d_vocab)
        if scores is not None and len(scores) != len(tokens):
            raise CheckpointError(f"{name}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        unk = header.value("tokenizer.ggml.unknown_token_id")
        unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
        if len(set(tokens)) != len(tokens):
            raise CheckpointError(f"{name}: tokenizer.ggml.tokens lists {len(tokens) - len(set(tokens))} entries twice")
        job: Future[HFTokenizer] = later(lambda: _build_when_started(start, tokens, kinds, unk_token))
        return Tokenizer(
            job, bos_token_id, source=f"{name} (tokenizer.ggml.*, SentencePiece BPE)", vocab_size=len(tokens),
            piece_bytes=sentencepiece_bytes,
        )  # fmt: skip
    kinds_read = "'gpt2' (byte-level BPE), or 'llama' (SentencePiece) on " + ", ".join(SENTENCEPIECE_ARCHITECTURES)
    raise CheckpointError(
        f"{name}: tokenizer.ggml.model {model!r} is not supported for architecture {arch!r} (read here: "
        f"{kinds_read}); convert the file's tokenizer to a tokenizer.json beside it"
    )


def _byte_level(
    header: GGUFHeader, tokens: list[str], kinds: np.ndarray, d_vocab: int, bos_token_id: int | None
) -> Tokenizer:
    name = header.name
    pre = header.value("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{name}: tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))} "
            f"(a tokenizer.json beside the file is read instead)"
        )
    merges = header.strings("tokenizer.ggml.merges", MERGES_PER_TOKEN * d_vocab) or []
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(pair) != 2 for pair in pairs):
        raise CheckpointError(f"{name}: tokenizer.ggml.merges must be strings 'left right'")
    special = [t for t, kind in zip(tokens, kinds.tolist(), strict=True) if kind in (CONTROL, USER_DEFINED)]
    return Tokenizer.from_bpe(
        tokens, pairs, special, byte_level_pre_tokenizer(PRE_TOKENIZERS[pre]), bos_token_id=bos_token_id,  # type: ignore[arg-type]
        source=f"{name} (tokenizer.ggml.*)",
    )  # fmt: skip


def _build_when_started(
    start: threading.Event | None, tokens: list[str], kinds: np.ndarray, unk_token: str | None
) -> HFTokenizer:
    if start is not None:
        start.wait()
    return sentencepiece_bpe(tokens, kinds, unk_token)


def sentencepiece_spelling(tokens: list[str]) -> list[str]:
    """The entries as BPE sees them: whitespace-only entries with their spaces spelled '▁' (the module docstring)."""
    return [t.replace(" ", SENTENCEPIECE_SPACE) if " " in t and not t.strip() else t for t in tokens]


def sentencepiece_bpe(tokens: list[str], kinds: np.ndarray, unk_token: str | None) -> HFTokenizer:
    """SentencePiece's BPE with byte fallback over a Gemma vocabulary (see the module docstring)."""
    spelled = sentencepiece_spelling(tokens)
    vocab = dict(zip(spelled, range(len(spelled)), strict=True))
    bpe = models.BPE(
        vocab=vocab, merges=sentencepiece_merges(spelled, vocab), unk_token=unk_token, fuse_unk=True, byte_fallback=True
    )
    hf = HFTokenizer(bpe)
    hf.normalizer = normalizers.Replace(" ", SENTENCEPIECE_SPACE)
    hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # (no space is left to split)
    hf.decoder = decoders.Sequence(
        [decoders.Replace(SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    kind = kinds.tolist()
    hf.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, kind, strict=True) if k == CONTROL]
    )
    hf.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, s, k in zip(tokens, spelled, kind, strict=True)
            if k == USER_DEFINED and t == s
        ]
    )
    return hf
