"""The skip-trigram report reads each head's OV path through the layer's output norm (Gemma 2/3, OLMo 2): the boosted
tokens are those of the head's write after the post-attention norm, computed here from the norm's gain directly."""

from __future__ import annotations

import pytest
import torch
from rotary_models import CASES, rotary_model

from circuits_core.prompt.phenomena import skip_trigram_report


class Names:
    """A tokenizer stand-in: token i decodes to a distinct word."""

    def decode(self, ids: list[int]) -> str:
        return f"w{ids[0]}"


@pytest.mark.parametrize("case", ["gemma3", "olmo2"])
def test_copying_fractions_follow_the_output_norm(case):
    model = rotary_model(seed=3, **CASES[case])
    gen = torch.Generator().manual_seed(1)
    windows = torch.randint(0, model.cfg.d_vocab, (6, 12), generator=gen)
    k, layer = 3, 0
    report = skip_trigram_report(model, Names(), windows, layer=layer, k=k)
    with torch.no_grad():
        _, cache = model.run(windows, names={f"blocks.{layer}.attn.hook_pattern"})
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][:, :, 1:, 1:]
        gain = model.blocks[layer].ln1_post.w  # [d_model]
        expected = []
        for h in range(model.cfg.n_heads):
            src = windows[:, 1:].gather(1, pattern[:, h].argmax(-1)).flatten()  # [b * q]
            write = model.W_E[src] @ model.W_V[layer, h] @ model.W_O[layer, h]  # [b * q, d_model], before the norm
            boosted = ((write * gain) @ model.W_U).topk(k, dim=-1).indices  # the norm's RMS scale is > 0
            expected.append(float((boosted == src[:, None]).any(1).double().mean()))
    assert report["copying_fraction_per_head"] == [round(f, 4) for f in expected]
