"""Claims about the shipped toy models that the engine's ablation must show (issue 12.7).

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

from circuits_core.ablation import ablate_head, head_ablation
from circuits_core.heads import standard_tokens
from circuits_core.weights import load_checkpoint

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.fixture(scope="module")
def toy2l():
    torch.set_num_threads(1)
    return load_checkpoint(ROOT / "toy-2l", dtype=torch.float64, process=False).model


def second_repeat_loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    T = (tokens.shape[1] - 1) // 2
    V = logits.shape[-1]
    return float(F.cross_entropy(logits[:, T:-1].reshape(-1, V), tokens[:, T + 1:].reshape(-1)))


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
