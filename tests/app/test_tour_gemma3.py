"""Every sentence of the tour's Gemma-3 270M chapter (app/tour/gemma3.py) recomputed independently on the real
model: G1's attention shares from the cached queries and keys (dense float64 softmax, causal mask only), with the
model's own patterns checked to be zero beyond the window where a causal-only softmax would not be; G2's ρ_k from a
plain forward pass's QK-norm scale at layer 0 for the two tokens named, and the extremes from a dense projection of
the whole vocabulary. Fails when models/gemma3-270m is not fetched (make gemma3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.tour import gemma3 as tg
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint

FOLDER = Path(__file__).resolve().parents[2] / "models" / tg.GEMMA3_MODEL
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemma3")]


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    if not any(FOLDER.glob("*.gguf")):
        pytest.fail(f"{FOLDER} has no GGUF: run `make gemma3` (`make test` runs it first)")
    return load_checkpoint(FOLDER)


def test_g1_windows(gemma: LoadedModel) -> None:
    sentence, claim = tg.windows(gemma)
    model, cfg = gemma.model, gemma.model.cfg
    tokens = tg.window_probe(gemma)
    n, w = tokens.shape[1], cfg.window_size
    assert w == claim.window == 512 and n > w
    wanted = {f"blocks.{layer}.attn.{x}" for layer in range(cfg.n_layers) for x in ("hook_q", "hook_k", "hook_pattern")}
    with torch.no_grad():
        _, cache = model.run(tokens, names=wanted)
    far = torch.ones(n, n, dtype=torch.bool).tril(-w)
    late = torch.arange(n) >= w
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    shares = {}
    for layer in range(cfg.n_layers):
        q = cache[f"blocks.{layer}.attn.hook_q"][0].double()  # [n, heads, d_head] (normalised and rotated)
        k = cache[f"blocks.{layer}.attn.hook_k"][0].double()  # [n, kv heads, d_head]
        k = k.repeat_interleave(cfg.n_heads // k.shape[1], dim=1)
        scores = torch.einsum("ihd,jhd->hij", q, k) / cfg.scale
        unwindowed = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [heads, n, n]
        mass = (unwindowed * far).sum(-1)[:, late]  # [heads, late queries]
        if cfg.attn_types[layer] == "local":
            assert layer not in claim.global_layers
            # the model's own pattern is zero there, where the scores alone would put attention
            assert cache[f"blocks.{layer}.attn.hook_pattern"][0][:, far].abs().max() == 0
            assert float(mass.max()) > 1e-3
        else:
            shares.update({f"L{layer}H{h}": float(mass[h].mean()) for h in range(cfg.n_heads)})
    assert claim.local_max == 0.0
    assert claim.global_layers == [5, 11, 17]
    mean = sum(shares.values()) / len(shares)
    assert abs(claim.global_share - mean) < 1e-5 and f"{100 * mean:.1f} %" in sentence
    top = max(shares, key=shares.__getitem__)
    assert claim.top_head == top and abs(claim.top_share - shares[top]) < 1e-5


def test_g2_qk_norm_scales(gemma: LoadedModel) -> None:
    sentence, claim = tg.qk_norm_scales(gemma)
    model = gemma.model
    (low, rho_low), (high, rho_high) = claim.low, claim.high
    with torch.no_grad():  # a plain forward pass: layer 0's key norm scale for the two tokens
        _, cache = model.run(torch.tensor([[low, high]]), names={"blocks.0.attn.k_norm.hook_scale"})
    scale = cache["blocks.0.attn.k_norm.hook_scale"][0, :, 0, 0].double()  # [2]
    assert torch.allclose(scale, torch.tensor([rho_low, rho_high], dtype=torch.float64), rtol=1e-4)
    # the extremes over the whole vocabulary, from the embedding by hand: x / rms(x) (ln1 folded into W_K) @ W_K
    W_E = model.embed.W_E.detach()
    x = W_E / (W_E.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
    k = x @ model.blocks[0].attn.grouped("W_K")[0].detach()  # [d_vocab, d_head]
    rho = (k.pow(2).mean(-1) + model.cfg.eps).sqrt()
    assert int(rho.argmin()) == low and int(rho.argmax()) == high
    assert abs(claim.factor - float(rho.max() / rho.min())) < 1e-3 * claim.factor
    assert f"a factor of {claim.factor:.0f}" in sentence
