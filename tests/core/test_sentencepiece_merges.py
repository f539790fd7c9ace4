"""The merges of a SentencePiece vocabulary found through hashes of the cuts (formats/sentencepiece_merges.py) against
the plain definition written here: every split of an entry into two entries, entry by entry in vocabulary order,
longer left piece first.

- A random vocabulary rich in splits (prefixes and suffixes of its entries are entries too), over characters of every
  width: ASCII, '▁', a newline, NUL, accented and CJK characters and emoji outside the basic plane.
- A vocabulary where a cut's left or right half, outside the vocabulary, has the hash of an entry of its length
  (hashes made weak on purpose): the character check must drop those merges.
- Entries sharing a hash, and entries longer than the hashed width: the loop is used, with the same result.
- Gemma-3 270M's 262,144 entries (the real file, `make gemma3`): the same 514,906 merges in the same order.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from circuits_core.formats import sentencepiece_merges as spm
from circuits_core.formats.sentencepiece_merges import sentencepiece_merges

GEMMA3 = Path(__file__).resolve().parents[2] / "models" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"


def merges_by_definition(entries: list[str]) -> list[tuple[str, str]]:
    known = set(entries)
    return [
        (entry[:cut], entry[cut:])
        for entry in entries
        for cut in reversed(range(1, len(entry)))
        if entry[:cut] in known and entry[cut:] in known
    ]


def random_vocabulary(seed: int, size: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("abcde▁\n\x00é") + ["日", "本", "🤖", "🚀", "\U0010fffd"]
    entries = dict.fromkeys(alphabet)
    while len(entries) < size:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 12)))
        entries[word] = None
        for cut in range(1, len(word)):  # many of its halves, so that most cuts are merges
            if rng.random() < 0.5:
                entries[word[:cut]] = None
            if rng.random() < 0.5:
                entries[word[cut:]] = None
    listed = list(entries)[:size]
    rng.shuffle(listed)  # places unrelated to lengths
    return listed


@pytest.fixture
def no_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if the hashed path gives up and uses the loop."""

    def refused(*args: object) -> None:
        raise AssertionError("the loop was used")

    monkeypatch.setattr(spm, "merges_by_loop", refused)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_vocabulary_rich_in_splits(seed: int, no_loop: None) -> None:
    entries = random_vocabulary(seed, 3000)
    expected = merges_by_definition(entries)
    assert len(expected) > 3000
    got = sentencepiece_merges(entries, {e: i for i, e in enumerate(entries)})
    assert got == expected


def test_a_half_outside_the_vocabulary_with_an_entry_s_hash_is_no_merge(
    monkeypatch: pytest.MonkeyPatch, no_loop: None
) -> None:
    # With B = 1 a hash is the sum of (code point + 1): 'bc' and 'da' (outside) sum like 'ad' (an entry), so the cuts
    # 'bc' + 'd' of 'bcd' and 'b' + 'da' of 'bda' each find two entries of the right lengths ('ad' and 'd', 'b' and
    # 'ad'); the entries' own sums are all different.
    monkeypatch.setattr(spm, "BASE", np.uint64(1))
    entries = ["a", "b", "c", "d", "ad", "bcd", "bda"]
    assert merges_by_definition(entries) == [("a", "d")]
    assert sentencepiece_merges(entries, {e: i for i, e in enumerate(entries)}) == [("a", "d")]


def test_entries_sharing_a_hash_or_too_long_to_hash_use_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = random_vocabulary(3, 500)
    expected = merges_by_definition(entries)
    vocab = {e: i for i, e in enumerate(entries)}
    used: list[int] = []
    loop = spm.merges_by_loop

    def counted(spelled: list[str], known: dict[str, int]) -> list[tuple[str, str]]:
        used.append(len(spelled))
        return loop(spelled, known)

    monkeypatch.setattr(spm, "merges_by_loop", counted)
    with monkeypatch.context() as weak:
        weak.setattr(spm, "BASE", np.uint64(1))  # anagrams ('ab', 'ba') share a sum
        assert sentencepiece_merges(entries, vocab) == expected
    long = [*entries, "a" * (spm.MAX_HASHED_CHARS + 1)]
    assert sentencepiece_merges(long, {e: i for i, e in enumerate(long)}) == merges_by_definition(long)
    assert used == [len(entries), len(long)]
    assert sentencepiece_merges(entries, vocab) == expected and len(used) == 2  # the hashed path otherwise


@pytest.mark.slow
@pytest.mark.xdist_group("gemma3")
def test_gemma3_vocabulary(no_loop: None) -> None:
    from circuits_core.formats.gguf_header import GGUFHeader
    from circuits_core.formats.gguf_tokenizer import sentencepiece_spelling

    if not GEMMA3.is_file():
        pytest.fail(f"{GEMMA3} is missing: run `make gemma3` (`make test` runs it first)")
    with GGUFHeader(GEMMA3) as header:
        tokens = header.strings("tokenizer.ggml.tokens", 262_144)
    assert tokens is not None
    entries = sentencepiece_spelling(tokens)
    expected = merges_by_definition(entries)
    assert len(expected) == 514_906
    assert sentencepiece_merges(entries, {e: i for i, e in enumerate(entries)}) == expected
