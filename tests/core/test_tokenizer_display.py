"""Readable byte-level BPE tokens: 'é' is shown as 'é', never as the byte alphabet's 'Ã©'.

References independent of circuits_core.formats.tokenizer's display code: Python's own UTF-8 codec on the text,
and the HF tokenizer's character offsets of each token (which character each token's bytes belong to).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from circuits_core.formats.tokenizer import Tokenizer, byte_level_bytes, readable_pieces

SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints" / "toy-2l"
TEXT = "café naïve — ok 日本 déjà"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    if not (SHIPPED / "tokenizer.json").is_file():
        pytest.skip("shipped toy-2l tokenizer not in this tree")
    found = Tokenizer.from_folder(SHIPPED)
    assert found is not None
    return found


def test_byte_alphabet_is_gpt2s() -> None:
    assert byte_level_bytes("Ġthe") == b" the"
    assert byte_level_bytes("Ċ") == b"\n"
    assert byte_level_bytes("Ã©") == "é".encode()
    assert byte_level_bytes("▁the") is None  # SentencePiece's marker is not a byte-level character


def test_every_character_is_shown_whole_on_the_token_that_completes_it(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, prepend_bos=False)
    shown = tok.token_strs(ids)
    offsets = tok.hf.encode(TEXT, add_special_tokens=False).offsets  # [n] (start, end) character spans
    assert len(offsets) == len(ids)
    for ch_index, ch in enumerate(TEXT):
        covering = [i for i, (a, b) in enumerate(offsets) if a <= ch_index < b]
        last = covering[-1]
        assert ch in shown[last], (ch, shown[last])
        for i in covering[:-1]:  # a token holding only the first bytes of a split character shows no letter
            assert ch not in shown[i] or ch in TEXT[offsets[i][0] : offsets[i][1]] and len(covering) == 1
    assert not any(c in "".join(shown) for c in "ÃĠâ¯")  # no byte-alphabet letters leak into the display
    split = [i for i, t in enumerate(shown) if t.startswith("\\x")]
    assert split, "the text was meant to split a character over tokens"
    for i in split:  # such a token shows exactly its bytes
        assert shown[i].encode().decode("unicode_escape").encode("latin-1") == byte_level_bytes(
            tok.hf.id_to_token(ids[i]) or ""
        )


def test_pieces_concatenate_back_to_the_text_when_no_character_is_split() -> None:
    pieces = [s.encode() for s in ["ca", "fé", " 日本", "!"]]
    assert "".join(readable_pieces(pieces)) == "café 日本!"


def test_a_single_partial_token_shows_its_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("é", prepend_bos=False)
    if len(ids) < 2:
        pytest.skip("é is one token in this vocabulary")
    first = tok.token_str(ids[0])
    assert first == "".join(
        f"\\x{b:02x}" for b in "é".encode()[: len(byte_level_bytes(tok.hf.id_to_token(ids[0]) or "") or b"")]
    )
