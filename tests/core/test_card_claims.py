"""Claims about the shipped toy models that the engine's ablation must show.

Removing toy-2l's previous-token head L0H5 breaks induction through K-composition: with later patterns recomputed
the loss on the second repeat of random tokens rises and the induction head L1H2 stops attending to the induction
target; with every pattern frozen (Olsson's ablation) the same removal looks harmless. References: the model with
W_O[L0H5] zeroed, run plainly (nothing frozen), and the induction score computed query by query.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.prompt.ablation import ablate_head, head_ablation
from circuits_core.prompt.detectors import standard_tokens

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.fixture(scope="module")
def toy2l():
    torch.set_num_threads(1)
    return load_checkpoint(ROOT / "toy-2l", dtype=torch.float64, process=False).model


def second_repeat_loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    T = (tokens.shape[1] - 1) // 2
    V = logits.shape[-1]
    return float(F.cross_entropy(logits[:, T:-1].reshape(-1, V), tokens[:, T + 1 :].reshape(-1)))


def induction_target_attention(pattern: torch.Tensor, T: int) -> float:
    """Mean over second-copy queries i of A[i, i - T + 1] (pattern [b, n, n] of one head)."""
    return float(torch.stack([pattern[:, i, i - T + 1] for i in range(T + 1, 2 * T + 1)]).mean())


def test_removing_the_previous_token_head_breaks_induction_only_when_patterns_recompute(toy2l):
    tokens = standard_tokens(toy2l)[:4]  # [4, 101]
    T = (tokens.shape[1] - 1) // 2
    names = lambda n: n == "blocks.1.attn.hook_pattern"  # noqa: E731
    clean_logits, clean = toy2l.run(tokens, names=names)
    edited = copy.deepcopy(toy2l)
    with torch.no_grad():
        edited.blocks[0].attn.W_O[5] = 0
    want_logits, want = edited.run(tokens, names=names)
    rec_logits, rec = ablate_head(toy2l, tokens, 0, 5, recompute_patterns=True, names=names)
    frz_logits, _ = ablate_head(toy2l, tokens, 0, 5, recompute_patterns=False, names=names)
    torch.testing.assert_close(rec_logits, want_logits, atol=1e-9, rtol=0)
    before = induction_target_attention(clean["blocks.1.attn.hook_pattern"][:, 2], T)
    after = induction_target_attention(want["blocks.1.attn.hook_pattern"][:, 2], T)
    assert before > 0.7 and after < 0.5 * before  # L1H2 loses its induction target without L0H5
    clean_loss = second_repeat_loss(clean_logits, tokens)
    assert second_repeat_loss(want_logits, tokens) - clean_loss > 1.0  # nats, recomputed: induction breaks
    assert abs(second_repeat_loss(frz_logits, tokens) - clean_loss) < 0.5  # frozen: looks unimportant
    losses = head_ablation(toy2l, tokens, recompute_patterns=True)
    frozen = head_ablation(toy2l, tokens)
    assert float(losses[0, 5]) > 10 * abs(float(frozen[0, 5]))


def _card(name: str) -> dict:
    import json

    return json.loads((ROOT / name / "model_card.json").read_text())


def _copying_scores(m) -> torch.Tensor:
    """[L, H] eigenvalue copying scores from the dense [d, d] W_V W_O W_U W_E (its d_head largest eigenvalues)."""
    out = torch.zeros(m.cfg.n_layers, m.cfg.n_heads, dtype=torch.float64)
    for layer in range(m.cfg.n_layers):
        for h in range(m.cfg.n_heads):
            eig = torch.linalg.eigvals(m.W_V[layer, h] @ m.W_O[layer, h] @ m.W_U @ m.W_E)
            eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
            out[layer, h] = eig.sum().real / eig.abs().sum()
    return out


def test_card_sentences_of_toy_0l():
    """'No positional embedding'; 'the held-out text (sparse: 26 files)'; 'approximates bigram statistics'."""
    card = _card("toy-0l")
    m = load_checkpoint(ROOT / "toy-0l", dtype=torch.float64, process=False).model
    assert m.cfg.positional_embedding_type == "none" and m.W_pos is None
    assert "26 files" in card["notes"] and card["data"]["val_files"] == 26
    assert "approximates bigram statistics" in card["description"] and card["thresholds"]["kl_ratio"]["met"]


def test_card_sentences_of_toy_1l():
    """'every head's OV circuit has a positive eigenvalue copying score, yet few tokens raise their own logit most';
    'all 8 heads had a positive OV copying score at step 800 (see history)'."""
    card = _card("toy-1l")
    m = load_checkpoint(ROOT / "toy-1l", dtype=torch.float64, process=False).model
    assert "every head's OV circuit has a positive eigenvalue copying score" in card["description"]
    assert (_copying_scores(m) > 0).all()
    own = torch.arange(m.cfg.d_vocab)
    top1 = [
        float(((m.W_E @ m.W_V[0, h] @ m.W_O[0, h] @ m.W_U).argmax(1) == own).double().mean())
        for h in range(m.cfg.n_heads)
    ]
    assert max(top1) < 0.01  # "few tokens": under 1 % in every head
    assert "all 8 heads had a positive OV copying score at step 800" in card["notes"]
    first = next(row["step"] for row in card["history"] if row.get("copying_positive_fraction") == 1.0)
    assert first == 800 and m.cfg.n_heads == 8


def test_card_sentences_of_toy_2l(toy2l):
    """'25 % of the rows are BOS + r + r + ... with r 8-63 random tokens drawn from the tokens seen >= 50 times';
    'an induction head in layer 1 K-composes with a previous-token head in layer 0'."""
    card = _card("toy-2l")
    recipe = card["recipe"]
    assert "25 % of the rows" in card["notes"] and recipe["repeat_frac"] == 0.25
    assert "r 8-63 random tokens" in card["notes"] and (recipe["repeat_min"], recipe["repeat_max"]) == (8, 63)
    from circuits_core.prompt.phenomena import MIN_TRAIN_COUNT

    assert "seen >= 50 times" in card["notes"] and MIN_TRAIN_COUNT == 50
    ph = card["phenomena"]  # the numbers themselves are re-measured in tests/core/test_shipped_models.py
    assert ph["induction_head"].startswith("L1") and ph["k_composition_partner"].startswith("L0")
    assert ph["induction_score"] >= 0.6 and ph["partner_previous_token_score"] >= 0.5


def test_card_sentences_of_toy_alibi_2l():
    """'it starts from toy-2l's weights (W_E, W_U and every head ...), with toy-2l's previous-token head L0H5 moved to
    head 0 (BLOOM's steepest slope, 1/2) and its induction head L1H2 to head 7 (the flattest, 1/256)'; 'its partner's
    previous-token score stays far below toy-2l's'; 'an induction head in layer 1 K-composes with a layer-0 head whose
    slope makes it prefer recent tokens'. The weights are compared with toy-2l's, not the recipe with itself."""
    card, base = _card("toy-alibi-2l"), _card("toy-2l")
    notes, ph, section = card["notes"], card["phenomena"], card["alibi"]
    assert card["recipe"]["init_from"] == "toy-2l" and "starts from toy-2l's weights" in notes
    assert (base["phenomena"]["k_composition_partner"], base["phenomena"]["induction_head"]) == ("L0H5", "L1H2")
    assert "moved to head 0 (BLOOM's steepest slope, 1/2)" in notes and "to head 7 (the flattest, 1/256)" in notes
    assert section["slopes"][0] == max(section["slopes"]) == 0.5 and section["slopes"][7] == min(section["slopes"])
    assert section["slopes"][7] == 1 / 256
    m = load_checkpoint(ROOT / "toy-alibi-2l", dtype=torch.float64, process=False).model
    b = load_checkpoint(ROOT / "toy-2l", dtype=torch.float64, process=False).model
    cos = lambda x, y: float((x * y).sum() / (x.norm() * y.norm()))  # noqa: E731
    assert cos(m.W_E, b.W_E) > 0.5 and cos(m.W_U, b.W_U) > 0.5
    for layer, mine, theirs in ((0, 0, 5), (1, 7, 2)):  # the moved heads: W_OV closest to the toy-2l head they were
        ov = m.W_V[layer, mine] @ m.W_O[layer, mine]
        near = [cos(ov, b.W_V[layer, h] @ b.W_O[layer, h]) for h in range(8)]
        assert max(range(8), key=near.__getitem__) == theirs and near[theirs] > 0.5
    assert "stays far below toy-2l's" in notes
    assert ph["partner_previous_token_score"] < 0.5 * base["phenomena"]["partner_previous_token_score"]
    assert ph["induction_head"].startswith("L1") and ph["k_composition_partner"].startswith("L0")
    assert ph["induction_score"] >= 0.6 and "whose slope makes it prefer recent tokens" in card["description"]
    after = section["partner_offset_attention"][1:]  # δ = 1, 2, 3, 4: falling with the offset
    assert all(a > b for a, b in zip(after, after[1:], strict=False))
