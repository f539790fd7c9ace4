"""Training code: the SDPA training forward equals Transformer.run; a tiny run learns and is deterministic."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from circuits_core.prompt.phenomena import EvalData
from circuits_core.training.corpus import Corpus, is_val
from circuits_core.training.recipes import Recipe, make_model
from circuits_core.training.train import Batches, train, training_logits

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.mark.parametrize(("n_layers", "alibi"), [(0, None), (1, None), (2, None), (2, "bloom"), (2, "mpt")])
def test_training_logits_equal_run(n_layers, alibi):
    """6 heads: BLOOM's and MPT's slopes differ (alibi.py), so a kernel built with the wrong rule fails."""
    recipe = Recipe(n_layers=n_layers, steps=1, d_model=36, n_heads=6, d_head=6, n_ctx=24, alibi=alibi)
    model = make_model(recipe, 300, 0).double()
    assert (model.W_pos is None) == (alibi is not None or n_layers == 0)
    with torch.no_grad():
        for p in model.parameters():  # larger weights so attention is far from uniform
            p.mul_(5.0)
    tokens = torch.randint(0, 300, (3, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(training_logits(model, tokens), model.run(tokens)[0], rtol=1e-10, atol=1e-10)


def test_split_is_by_file_hash():
    import hashlib

    for rel in ["os.py", "json/decoder.py", "asyncio/tasks.py", "a/b.py"]:
        assert is_val(rel) == (int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20 == 0)


def _small_corpus() -> Corpus:
    data = EvalData.load(ROOT / "eval_data.npz")
    tok = Tokenizer.from_file(str(ROOT / "toy-2l" / "tokenizer.json"))
    return Corpus(data.val[:40_000].copy(), data.val[40_000:60_000].copy(), tok, [], source="test slice")


def test_batches_rows():
    corpus = _small_corpus()
    r = Recipe(n_layers=1, steps=1, batch=64, n_ctx=32, repeat_frac=0.5, seed=3)
    rows = Batches(corpus.train, r, corpus.eot, np.arange(5, 50)).next()
    assert rows.shape == (64, 32) and bool((rows[:, 0] == corpus.eot).all())
    repeated = [row for row in rows if int(row[1:].max()) < 50 and int(row[1:].min()) >= 5]
    assert 16 <= len(repeated) <= 48
    again = Batches(corpus.train, r, corpus.eot, np.arange(5, 50)).next()
    assert torch.equal(rows, again)


@pytest.mark.slow
def test_tiny_training_learns_and_is_deterministic(tmp_path):
    torch.set_num_threads(1)
    corpus = _small_corpus()
    recipe = Recipe(
        n_layers=2,
        steps=200,
        d_model=32,
        n_heads=2,
        d_head=16,
        n_ctx=32,
        batch=8,
        lr=3e-3,
        repeat_frac=0.25,
        eval_every=100,
    )
    card = train("tiny", recipe, corpus, tmp_path, "cpu", progress=False)
    losses = [row["val_loss"] for row in card["history"]]
    assert card["training"]["steps"] == 200 and len(losses) == 2
    assert losses[-1] < np.log(corpus.tokenizer.get_vocab_size()) - 1.0  # far below the uniform 8.3
    assert card["phenomena"]["val_loss"] < 7.0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "model_card.json"):
        assert (tmp_path / "tiny" / name).is_file()
    # Same seed, same weights; another seed, other weights (short runs).
    short = dataclasses.replace(recipe, steps=20, eval_every=20)
    a = train("a", short, corpus, tmp_path, "cpu", progress=False)
    b = train("b", short, corpus, tmp_path, "cpu", progress=False)
    train("c", dataclasses.replace(short, seed=1), corpus, tmp_path, "cpu", progress=False)
    wa, wb, wc = ((tmp_path / n / "model.safetensors").read_bytes() for n in "abc")
    assert wa == wb and wa != wc
    assert a["history"][-1]["train_loss"] == b["history"][-1]["train_loss"]


def test_alibi_run_saves_an_alibi_toy_and_stops_when_asked(tmp_path):
    """A short ALiBi run writes qkov's format with alibi "bloom" and no positional table, and a card with the ALiBi
    section and the CPU time; a run whose stop is set ends after its first step, evaluated and saved."""
    import threading

    torch.set_num_threads(1)
    corpus = _small_corpus()
    recipe = Recipe(
        n_layers=2, steps=30, d_model=16, n_heads=4, d_head=4, n_ctx=32, batch=4, alibi="bloom", eval_every=15
    )
    card = train("tiny-alibi", recipe, corpus, tmp_path, "cpu", progress=False)
    config = json.loads((tmp_path / "tiny-alibi" / "config.json").read_text())
    assert config["alibi"] == "bloom" and config["positional_embedding_type"] == "none"
    assert card["alibi"]["slopes"] == [0.25, 0.0625, 0.015625, 0.00390625]  # BLOOM's 2^(-8h/4)
    assert card["training"]["steps"] == 30 and card["training"]["cpu_seconds"] > 0
    stop = threading.Event()
    stop.set()
    stopped = train("stopped", recipe, corpus, tmp_path, "cpu", progress=False, stop=stop)
    assert stopped["training"]["steps"] == 1 and [row["step"] for row in stopped["history"]] == [1]


def test_init_from_moves_the_named_heads(tmp_path):
    """init_from + init_heads: head h of layer l starts as the earlier toy's head init_heads[l][h] (W_Q, W_K, W_V,
    W_O), W_E and W_U are its own; a shortformer toy's positions are left behind under ALiBi."""
    from circuits_core.formats.qkov_format import save_checkpoint

    shape = dict(n_layers=2, steps=1, d_model=16, n_heads=4, d_head=4, n_ctx=16)
    source = make_model(Recipe(**shape, seed=5), 300, 0)
    save_checkpoint(source, tmp_path / "before")
    order = ((3, 1, 2, 0), (0, 2, 1, 3))
    moved = make_model(Recipe(**shape, alibi="bloom", init_from="before", init_heads=order), 300, 0, tmp_path)
    assert moved.W_pos is None and torch.equal(moved.W_E, source.W_E) and torch.equal(moved.W_U, source.W_U)
    for layer in range(2):
        for h in range(4):
            for name in ("W_Q", "W_K", "W_V", "W_O"):
                mine = getattr(moved.blocks[layer].attn, name)[h]
                assert torch.equal(mine, getattr(source.blocks[layer].attn, name)[order[layer][h]])
