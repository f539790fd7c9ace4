"""The shipped ALiBi toy (checkpoints/toy-alibi-2l): the "alibi" section of its model card, recomputed from the
shipped weights by a forward pass written here in float64 (safetensors read directly, the slopes from transformers'
BLOOM `build_alibi_tensor`, plain torch attention), with none of circuits_core's model or measuring code; and the
sentences of its card. The phenomena every toy reports are re-measured in tests/core/test_shipped_models.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from circuits_core.formats.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"
NAME = "toy-alibi-2l"


def bloom_slopes(n_heads: int) -> torch.Tensor:
    """m_h [H] from transformers' BLOOM: its ALiBi tensor at key position 1 is m_h · 1."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    return build_alibi_tensor(torch.ones(1, 2), n_heads, torch.float64)[:, 0, 1]


class Reference:
    """The toy's forward pass from its files: x = W_E[t]; per layer, scores = q kᵀ / √d_head − m_h (i − j), causal
    softmax, x += Σ_h A_h (x W_V^h) W_O^h; logits = x W_U."""

    def __init__(self, folder: Path):
        self.cfg = json.loads((folder / "config.json").read_text())
        self.w = {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.m = bloom_slopes(self.cfg["n_heads"])

    def run(self, tokens: torch.Tensor, without: tuple[int, int] | None = None) -> dict[str, object]:
        """logits [b, n, V], patterns and content terms per layer [b, H, n, n]; `without`: that head's output zeroed."""
        w, n = self.w, tokens.shape[1]
        x = w["embed.W_E"][tokens]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        patterns, contents = [], []
        for layer in range(self.cfg["n_layers"]):
            a = f"blocks.{layer}.attn"
            q = torch.einsum("bpd,hde->bhpe", x, w[f"{a}.W_Q"])
            k = torch.einsum("bpd,hde->bhpe", x, w[f"{a}.W_K"])
            v = torch.einsum("bpd,hde->bhpe", x, w[f"{a}.W_V"])
            content = q @ k.transpose(-1, -2) / self.cfg["d_head"] ** 0.5  # [b, H, n, n]
            scores = content - self.m[:, None, None] * (i - j)
            A = scores.masked_fill(j > i, float("-inf")).softmax(-1)
            out = torch.einsum("bhpe,hed->bhpd", A @ v, w[f"{a}.W_O"])  # [b, H, n, d]
            if without is not None and without[0] == layer:
                out[:, without[1]] = 0
            x = x + out.sum(1)
            patterns.append(A)
            contents.append(content)
        return {"logits": x @ w["unembed.W_U"], "patterns": patterns, "contents": contents}


@pytest.fixture(scope="module")
def toy():
    torch.set_num_threads(1)
    folder = ROOT / NAME
    card = json.loads((folder / "model_card.json").read_text())
    return Reference(folder), card


def repeated(batch: int, length: int, copies: int, bos: int, seed: int = 0) -> torch.Tensor:
    """BOS + r + ... + r, r uniform over 4096 tokens (the app's standard input and Olsson's, built here)."""
    r = torch.randint(0, 4096, (batch, length), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.full((batch, 1), bos), r.repeat(1, copies)], dim=1)


def induction_score(A: torch.Tensor, tokens: torch.Tensor) -> float:
    """Mean over queries i whose token occurred at j' < i of the attention on the keys j' + 1 (query by query)."""
    mass, rows = 0.0, 0
    for b, seq in enumerate(tokens.tolist()):
        for i in range(len(seq)):
            keys = [j + 1 for j in range(i) if seq[j] == seq[i]]
            if keys:
                mass, rows = mass + float(A[b, i, keys].sum()), rows + 1
    return mass / rows


def loss_of(logits: torch.Tensor, tokens: torch.Tensor, start: int, stop: int) -> float:
    """Mean loss of predicting tokens[:, start + 1 : stop + 1] from positions start .. stop - 1."""
    V = logits.shape[-1]
    return float(F.cross_entropy(logits[:, start:stop].reshape(-1, V), tokens[:, start + 1 : stop + 1].reshape(-1)))


def test_reference_forward_is_the_engines(toy):
    ref, card = toy
    model = load_checkpoint(ROOT / NAME, dtype=torch.float64, process=False).model
    assert model.cfg.alibi == "bloom" and model.W_pos is None and model.cfg.attn_only
    tokens = repeated(2, 50, 2, ref.cfg["bos_token_id"])
    torch.testing.assert_close(model.run(tokens)[0], ref.run(tokens)["logits"], rtol=0, atol=1e-9)


def test_slopes_and_the_exactly_linear_kernel(toy):
    """The card's slopes are BLOOM's; its kernel (scores minus q·k / scale, measured by the engine in float32) is
    −m_h (i − j): the fitted slopes are −m_h and the largest deviation is float32 rounding. In float64 the engine's
    scores minus the content computed here are −m_h (i − j) to 1e-10."""
    ref, card = toy
    section = card["alibi"]
    assert section["rule"] == "bloom"
    torch.testing.assert_close(torch.tensor(section["slopes"], dtype=torch.float64), ref.m, rtol=0, atol=1e-15)
    fitted = torch.tensor(section["kernel"]["fitted_slopes"], dtype=torch.float64)  # [L, H]
    torch.testing.assert_close(fitted, -ref.m.expand_as(fitted), rtol=0, atol=2e-5)
    assert section["kernel"]["max_deviation_from_linear"] < 1e-3
    model = load_checkpoint(ROOT / NAME, dtype=torch.float64, process=False).model
    tokens = repeated(2, 50, 2, ref.cfg["bos_token_id"])
    _, cache = model.run(tokens, names=lambda k: k.endswith("hook_attn_scores"))
    n = tokens.shape[1]
    i, j = torch.tril_indices(n, n)
    for layer, content in enumerate(ref.run(tokens)["contents"]):
        positional = (cache[f"blocks.{layer}.attn.hook_attn_scores"] - content)[:, :, i, j]  # [b, H, e]
        want = (-ref.m[:, None] * (i - j).double()).expand_as(positional)
        torch.testing.assert_close(positional, want, rtol=0, atol=1e-10)


def test_offset_attention_of_the_two_heads(toy):
    ref, card = toy
    section = card["alibi"]
    tokens = repeated(10, 50, 2, ref.cfg["bos_token_id"])
    patterns = ref.run(tokens)["patterns"]
    for key, head in (("partner", section["partner"]), ("induction", section["induction_head"])):
        layer, h = int(head[1]), int(head[3:])
        A = patterns[layer][:, h]
        want = [
            sum(float(A[b, i, i - d]) for b in range(10) for i in range(5, tokens.shape[1]))
            / (10 * (tokens.shape[1] - 5))
            for d in range(5)
        ]
        assert section[f"{key}_offset_attention"] == pytest.approx(want, abs=2e-4), key
        assert section[f"{key}_slope"] == pytest.approx(float(ref.m[h]), abs=1e-15)
    assert section["partner"] == card["phenomena"]["k_composition_partner"]
    assert section["induction_head"] == card["phenomena"]["induction_head"]


def test_copy_losses_on_four_copies(toy):
    ref, card = toy
    tokens = repeated(10, 25, 4, ref.cfg["bos_token_id"])
    logits = ref.run(tokens)["logits"]
    want = [loss_of(logits, tokens, c * 25, (c + 1) * 25) for c in range(4)]
    assert card["alibi"]["copy_losses"] == pytest.approx(want, abs=2e-3)


def test_removing_the_partner_breaks_induction(toy):
    ref, card = toy
    section = card["alibi"]["ablation"]
    partner, head = card["alibi"]["partner"], card["alibi"]["induction_head"]
    tokens = repeated(10, 50, 2, ref.cfg["bos_token_id"])
    clean, cut = ref.run(tokens), ref.run(tokens, without=(int(partner[1]), int(partner[3:])))
    h = int(head[3:])
    want = {
        "induction_score": induction_score(clean["patterns"][1][:, h], tokens),
        "induction_score_without_partner": induction_score(cut["patterns"][1][:, h], tokens),
        "rep2_loss": loss_of(clean["logits"], tokens, 50, 100),
        "rep2_loss_without_partner": loss_of(cut["logits"], tokens, 50, 100),
    }
    for key, value in want.items():
        assert section[key] == pytest.approx(value, abs=2e-3), key
