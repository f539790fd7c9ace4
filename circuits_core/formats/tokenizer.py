"""Tokenizers: a thin wrapper over the HF `tokenizers` library, offline only.

Sources, in order: `tokenizer.json` (any model the library can describe), or GPT-2's `vocab.json` +
`merges.txt` (byte-level BPE). Token ids index the rows of W_E (`[d_vocab, d_model]`) and the columns of
W_U (`[d_model, d_vocab]`). Positions in every metric assume the BOS token at position 0 (TransformerLens's
`prepend_bos=True` default), so `encode` prepends it unless told not to.

Byte-level BPE stores a leading space as 'Ġ' and a newline as 'Ċ'; `token_str` shows the decoded text
(' the', '\\n') so charts and JSON read naturally. A token holding only part of a UTF-8 character ('Ã' is
the byte 0xC3, the first half of 'é') is shown as its bytes ('\\xc3'), never as the byte alphabet's letters;
in a sequence (`token_strs`) the character is shown whole on the token that completes it (`readable_pieces`).
SentencePiece vocabularies (Gemma's) spell a space '▁' and fall back to byte pieces '<0xC3>'; `sentencepiece_bytes`
reads those the same way.

Bounds: what parsing a tokenizer costs grows with its files' bytes (the `tokenizers` library holds a parsed
tokenizer.json in about 15 times its size while it builds), so a folder's tokenizer files are priced by the model's
vocabulary before they are parsed: at most TOKENIZER_BYTES_PER_TOKEN bytes per row of W_E plus
TOKENIZER_BASE_BYTES (normaliser, pre-tokenizer, added tokens of a small vocabulary). Gemma 3's 262,144-entry
tokenizer.json (about 33 MB: each entry and its two merges, pretty-printed, take about 126 bytes) is well inside its
allowance of 136 MiB; a file listing far more entries than the model has rows is refused before it is read. After
the parse, the vocabulary may not hold more ids than W_E has rows (checkpoint.py's _build).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from circuits_core.errors import CheckpointError, InvalidInputError, NotFoundError
from circuits_core.formats.load_watchdog import TOKENIZER_PARSE_FACTOR, reserve
from circuits_core.formats.statedict import read_json_object

DEFAULT_BOS = "<|endoftext|>"
TOKENIZER_BYTES_PER_TOKEN = 512  # a pretty-printed entry with up to 4 merges takes about 220 bytes
TOKENIZER_BASE_BYTES = 8 * 1024 * 1024


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE (printable Latin-1 bytes map to
    themselves, the other 68 bytes to U+0100 onwards, in byte order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}
SENTENCEPIECE_SPACE = "\u2581"  # '▁': SentencePiece's spelling of a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback piece of a SentencePiece vocabulary


def byte_level_bytes(entry: str) -> bytes | None:
    """The bytes a byte-level BPE vocabulary entry stands for ('Ã©' -> b'\\xc3\\xa9'); None if it is not one."""
    try:
        return bytes(BYTE_OF_CHAR[c] for c in entry)
    except KeyError:
        return None


def sentencepiece_bytes(entry: str) -> bytes | None:
    """The bytes a SentencePiece vocabulary entry stands for: '<0xC3>' -> b'\\xc3' (byte fallback), '▁the' ->
    b' the'."""
    byte = _BYTE_PIECE.fullmatch(entry)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    return entry.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")


def _unfinished(data: bytes) -> int:
    """Where an unfinished UTF-8 character at the end of `data` starts (len(data) when the end is complete)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # ASCII or a start byte: how many bytes its character needs
            need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            return len(data) - back if need > back else len(data)
    return len(data)


def readable_pieces(pieces: list[bytes]) -> list[str]:
    """The text of consecutive tokens given their bytes: each character on the token that completes it; a
    token that completes no character shows its own bytes as escapes ('\\xc3'), as do invalid bytes. Without
    split characters the pieces concatenate back to the decoded text."""
    out: list[str] = []
    pending = b""  # the start of a character begun by earlier tokens
    for piece in pieces:
        data = pending + piece
        cut = _unfinished(data)
        text, pending = data[:cut].decode("utf-8", errors="backslashreplace"), data[cut:]
        out.append(text or piece.decode("utf-8", errors="backslashreplace"))
    if pending and out and out[-1] != pieces[-1].decode("utf-8", errors="backslashreplace"):
        out[-1] += pending.decode("utf-8", errors="backslashreplace")  # the text ends inside a character
    return out


def tokenizer_allowance(max_tokens: int) -> int:
    """Bytes of tokenizer files a vocabulary of `max_tokens` entries may hold (the module's Bounds)."""
    return TOKENIZER_BASE_BYTES + TOKENIZER_BYTES_PER_TOKEN * max_tokens


def check_tokenizer_bytes(paths: list[Path], max_tokens: int | None) -> None:
    """Refuse tokenizer files larger than a vocabulary of `max_tokens` entries needs, before they are parsed."""
    if max_tokens is None:
        return
    size, allowance = sum(p.stat().st_size for p in paths), tokenizer_allowance(max_tokens)
    if size > allowance:
        raise CheckpointError(
            f"{' + '.join(p.name for p in paths)}: {size} bytes for a model of {max_tokens} tokens; a tokenizer of "
            f"that vocabulary takes at most {allowance} bytes ({TOKENIZER_BYTES_PER_TOKEN} per token + "
            f"{TOKENIZER_BASE_BYTES}), so it is refused before it is parsed"
        )
    reserve(TOKENIZER_PARSE_FACTOR * size, f"parsing {' + '.join(p.name for p in paths)}")  # the load's watchdog


def _special_token_name(value: object) -> str | None:
    """`bos_token` in tokenizer_config.json is a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """Encode text to token ids and show ids as readable strings."""

    def __init__(
        self,
        hf: HFTokenizer | Future[HFTokenizer],
        bos_token_id: int | None = None,
        source: str = "",
        vocab_size: int | None = None,
        piece_bytes: Callable[[str], bytes | None] = byte_level_bytes,
    ):
        """`hf` may be a Future (a tokenizer still being built, e.g. Gemma's 262k-entry vocabulary, built beside the
        weights while they load): then `vocab_size` must be given, and the first use waits for it."""
        self._hf, self.source, self.piece_bytes = hf, source, piece_bytes
        self._vocab_size = vocab_size
        if bos_token_id is None:
            bos_token_id = self.hf.token_to_id(DEFAULT_BOS)
        if bos_token_id is not None and not 0 <= bos_token_id < self.vocab_size:
            raise InvalidInputError(f"bos_token_id {bos_token_id} is outside the vocabulary of {self.vocab_size}")
        self.bos_token_id: int | None = bos_token_id

    @property
    def hf(self) -> HFTokenizer:
        """The `tokenizers` tokenizer (waiting for it when it is still being built)."""
        if isinstance(self._hf, Future):
            self._hf = self._hf.result()
        return self._hf

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path, bos_token_id: int | None = None) -> Tokenizer:
        """From a `tokenizer.json`."""
        path = Path(path)
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on malformed JSON
            raise CheckpointError(f"{path}: not a readable tokenizer.json ({exc})") from exc
        return cls(hf, bos_token_id, source=str(path))

    @classmethod
    def from_vocab_merges(cls, vocab: str | Path, merges: str | Path, bos_token_id: int | None = None) -> Tokenizer:
        """GPT-2's byte-level BPE from `vocab.json` + `merges.txt`."""
        try:
            bpe = models.BPE.from_file(str(vocab), str(merges))
        except Exception as exc:
            raise CheckpointError(f"{vocab} / {merges}: not a readable BPE vocabulary ({exc})") from exc
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        if hf.token_to_id(DEFAULT_BOS) is not None:
            hf.add_special_tokens([DEFAULT_BOS])  # so "<|endoftext|>" in text encodes to its one id
        return cls(hf, bos_token_id, source=str(vocab))

    @classmethod
    def from_bpe(
        cls,
        tokens: list[str],
        merges: list[tuple[str, str]],
        special: list[str],
        pre_tokenizer: pre_tokenizers.PreTokenizer,
        bos_token_id: int | None = None,
        source: str = "",
    ) -> Tokenizer:
        """A byte-level BPE from its parts (a GGUF file's metadata): `tokens[i]` is the vocabulary entry of id
        i, `merges` in rank order, `special` the entries that encode as themselves (control tokens), and
        `pre_tokenizer` splits the text into the pieces BPE merges within (gguf_tokenizer.byte_level_pre_tokenizer)."""
        vocab = {token: i for i, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise CheckpointError(f"{source}: the vocabulary lists {len(tokens) - len(vocab)} entries twice")
        try:
            hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
        except Exception as exc:  # the library raises a bare Exception on a merge of unknown tokens
            raise CheckpointError(f"{source}: not a consistent BPE vocabulary ({exc})") from exc
        hf.pre_tokenizer = pre_tokenizer
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens(special)  # so "<|im_start|>" in text encodes to its one id
        return cls(hf, bos_token_id, source=source)

    @classmethod
    def from_folder(
        cls, folder: str | Path, bos_token_id: int | None = None, max_tokens: int | None = None
    ) -> Tokenizer | None:
        """The tokenizer stored in a model folder, or None when there is none.

        BOS: the explicit id, else `bos_token` of tokenizer_config.json / special_tokens_map.json, else
        "<|endoftext|>" when the vocabulary has it. `max_tokens` (the rows of W_E): the tokenizer files are refused
        before they are parsed when they hold more bytes than a vocabulary of that size needs (the module's Bounds).
        """
        folder = Path(folder)
        tok = cls._load(folder, bos_token_id, max_tokens)
        if tok is None or bos_token_id is not None:
            return tok
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if not (folder / name).is_file():
                continue
            bos_name = _special_token_name(read_json_object(folder, name).get("bos_token"))
            if bos_name is not None and tok.hf.token_to_id(bos_name) is not None:
                tok.bos_token_id = tok.hf.token_to_id(bos_name)
                break
        return tok

    @classmethod
    def _load(cls, folder: Path, bos_token_id: int | None, max_tokens: int | None) -> Tokenizer | None:
        if (folder / "tokenizer.json").is_file():
            check_tokenizer_bytes([folder / "tokenizer.json"], max_tokens)
            return cls.from_file(folder / "tokenizer.json", bos_token_id)
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            check_tokenizer_bytes([folder / "vocab.json", folder / "merges.txt"], max_tokens)
            return cls.from_vocab_merges(folder / "vocab.json", folder / "merges.txt", bos_token_id)
        return None

    def to_json(self) -> str:
        """The `tokenizer.json` text (save_checkpoint writes it next to the weights)."""
        return self.hf.to_str()

    # ---- use ---------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            self._vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        return self._vocab_size

    def encode(self, text: str, prepend_bos: bool = True) -> list[int]:
        """Token ids of `text`, with the BOS id first when `prepend_bos` (an error if there is no BOS)."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a string, got {type(text).__name__}")
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if prepend_bos:
            if self.bos_token_id is None:
                raise InvalidInputError("this tokenizer has no BOS token; encode with prepend_bos=False")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode([self._check_id(i) for i in ids], skip_special_tokens=False)

    def token_str(self, token_id: int) -> str:
        """Readable text of one token: ' the' for 'Ġthe', '\\n' for 'Ċ', '<|endoftext|>' for specials."""
        token_id = self._check_id(token_id)
        return self.token_strs([token_id])[0]

    def token_strs(self, ids: list[int]) -> list[str]:
        """Readable text of consecutive tokens (a prompt): a character split over tokens ('é' = 'Ã' + '©' in
        byte-level BPE) is shown whole on the token that completes it (`readable_pieces`)."""
        texts = [self.hf.decode([self._check_id(i)], skip_special_tokens=False) for i in ids]
        pieces = [self.piece_bytes(self.hf.id_to_token(i) or "") for i in ids]
        if all("\ufffd" not in t for t in texts) or any(p is None for p in pieces):
            return texts
        return readable_pieces([p for p in pieces if p is not None])

    def lookup(self, token: str | int) -> int:
        """The id of a single token, given as its id, its text (' the') or its vocabulary entry ('Ġthe')."""
        if isinstance(token, bool) or not (isinstance(token, str) or hasattr(token, "__index__")):
            raise InvalidInputError(f"a token is an id or a string, got {type(token).__name__}")
        if not isinstance(token, str):
            return self._check_id(token)
        ids = self.hf.encode(token, add_special_tokens=False).ids
        if len(ids) == 1:
            return ids[0]
        raw = self.hf.token_to_id(token)
        if raw is not None:
            return raw
        if not ids:
            raise NotFoundError(f"{token!r} encodes to no tokens; give a non-empty string or a token id")
        pieces = ", ".join(f"{self.token_str(i)!r} ({i})" for i in ids)
        raise NotFoundError(f"{token!r} is not a single token: it encodes to {len(ids)} tokens: {pieces}")

    def _check_id(self, token_id: int) -> int:
        if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
            raise InvalidInputError(f"a token id is an integer, got {type(token_id).__name__}")
        token_id = operator.index(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise NotFoundError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return token_id

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, source={self.source!r})"
