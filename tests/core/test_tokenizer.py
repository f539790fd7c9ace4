"""Tokenizer wrapper: tokenizer.json and GPT-2 vocab.json + merges.txt agree, BOS, readable tokens, lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from circuits_core.errors import CheckpointError, InvalidInputError, NotFoundError
from circuits_core.formats.tokenizer import Tokenizer
from tests.bpe import train_bpe

CORPUS = [
    "the cat sat on the mat. the dog sat on the log.",
    "Mr and Mrs Dursley, of number four, Privet Drive, were proud to say that they were perfectly normal.",
    "def add(a, b):\n    return a + b\n",
] * 20


def _train(folder: Path) -> HFTokenizer:
    """A tiny byte-level BPE written both as tokenizer.json and as vocab.json + merges.txt."""
    hf = train_bpe(CORPUS, vocab_size=400)
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    hf.model.save(str(folder))  # vocab.json + merges.txt
    return hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    _train(path)
    return path


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(folder / "tokenizer.json")


def test_encode_decode_roundtrip_and_bos(tok: Tokenizer) -> None:
    text = "the cat sat on the log.\n  Mrs Dursley!"
    ids = tok.encode(text)
    assert tok.bos_token_id == tok.hf.token_to_id("<|endoftext|>")
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, prepend_bos=False) == ids[1:]
    assert tok.decode(ids[1:]) == text
    assert "".join(tok.token_strs(ids[1:])) == text  # readable pieces concatenate back to the text


def test_vocab_merges_matches_tokenizer_json(folder: Path, tok: Tokenizer) -> None:
    gpt2_style = Tokenizer.from_vocab_merges(folder / "vocab.json", folder / "merges.txt")
    text = "the dog sat on the mat, def add(a, b): return a + b <|endoftext|> unseen words zq"
    assert gpt2_style.encode(text) == tok.encode(text)
    assert gpt2_style.vocab_size == tok.vocab_size
    assert gpt2_style.bos_token_id == tok.bos_token_id
    assert gpt2_style.lookup("<|endoftext|>") == tok.bos_token_id


def test_token_str_shows_spaces_and_newlines(tok: Tokenizer) -> None:
    the = tok.hf.token_to_id("Ġthe")
    assert the is not None, "the trained vocabulary should merge ' the'"
    assert tok.token_str(the) == " the"
    newline = tok.hf.token_to_id("Ċ")
    assert tok.token_str(newline) == "\n"
    assert tok.token_str(tok.bos_token_id) == "<|endoftext|>"


def test_lookup(tok: Tokenizer) -> None:
    the = tok.hf.token_to_id("Ġthe")
    assert tok.lookup(" the") == the
    assert tok.lookup("Ġthe") == the  # the raw vocabulary entry works too
    assert tok.lookup(the) == the
    with pytest.raises(NotFoundError, match=r"encodes to \d+ tokens: ' the' .*"):
        tok.lookup(" the zqxj")
    with pytest.raises(NotFoundError, match="outside the vocabulary"):
        tok.lookup(tok.vocab_size)
    with pytest.raises(NotFoundError, match="outside the vocabulary"):
        tok.token_str(-1)
    with pytest.raises(NotFoundError, match="no tokens"):
        tok.lookup("")
    with pytest.raises(InvalidInputError):
        tok.lookup(1.5)  # type: ignore[arg-type]


def test_from_folder_bos_from_tokenizer_config(tmp_path: Path) -> None:
    hf = _train(tmp_path)
    assert Tokenizer.from_folder(tmp_path).bos_token_id == hf.token_to_id("<|endoftext|>")  # type: ignore[union-attr]
    other = hf.id_to_token(5)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": other}}))
    assert Tokenizer.from_folder(tmp_path).bos_token_id == 5  # type: ignore[union-attr]
    assert Tokenizer.from_folder(tmp_path, bos_token_id=7).bos_token_id == 7  # type: ignore[union-attr]
    (tmp_path / "tokenizer.json").unlink()
    assert Tokenizer.from_folder(tmp_path).bos_token_id == 5  # type: ignore[union-attr]  # vocab + merges
    assert Tokenizer.from_folder(tmp_path / "missing") is None


def test_no_bos_and_bad_files(tmp_path: Path) -> None:
    hf = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer(hf)
    assert tok.bos_token_id is None
    assert tok.encode("a b a", prepend_bos=False) == [0, 1, 0]
    with pytest.raises(InvalidInputError, match="no BOS"):
        tok.encode("a")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
