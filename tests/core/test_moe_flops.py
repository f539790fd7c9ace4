"""The forward-pass price of mixture-of-experts models is what torch counts (model/flops.mlp_flops).

A mixture's MLP costs its router's logits, experts_per_token experts per token (not one expert's width) and, on
DeepSeek, the always-on shared experts; DeepSeek's first layers are dense MLPs of their own width (d_mlp_dense).
torch's FlopCounterMode counts every matrix product the engine runs, independently of the engine's formulas: over
one forward pass (frozen.forward_cost) and over term importance's clean run, order reruns and head ablations
(ablation.cost), on gpt-oss-, OLMoE- and DeepSeek-V3-shaped models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model.transformer import Transformer, random_model
from circuits_core.prompt import ablation
from circuits_core.prompt.frozen import forward_cost
from tests.core.hf_families import save
from tests.core.test_deepseek_hf import deepseek_model
from tests.core.test_moe_paths import CONFIGS


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Transformer]:
    folder = save(deepseek_model("v3"), Path(tmp_path_factory.mktemp("moe_flops") / "v3"))
    out = {name: random_model(cfg, seed=1, dtype=torch.float64) for name, cfg in CONFIGS.items()}
    out["deepseek-v3"] = load_checkpoint(folder, dtype=torch.float64).model
    return out


def counted(call) -> int:  # type: ignore[no-untyped-def]
    with FlopCounterMode(display=False) as counter:
        call()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["gpt-oss", "olmoe", "deepseek-v3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_forward_pass_is_priced_as_counted(models: dict[str, Transformer], name: str, batch: int) -> None:
    model = models[name]
    tokens = torch.randint(0, model.cfg.d_vocab, (batch, 9), generator=torch.Generator().manual_seed(batch))
    assert counted(lambda: model(tokens)) == forward_cost(model, 9, batch).flops
    if name == "deepseek-v3":  # a dense first layer, routed and shared experts after it
        assert model.cfg.moe_dense_layers == 1 and model.cfg.moe_shared_d_mlp is not None


@pytest.mark.parametrize("name", ["gpt-oss", "deepseek-v3"])
def test_term_importance_is_priced_as_counted(models: dict[str, Transformer], name: str) -> None:
    model = models[name]
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 8), generator=torch.Generator().manual_seed(3))
    heads = [(0, 1), (1, 0), (model.cfg.n_layers - 1, 2)]

    def run() -> None:
        clean = ablation.clean_run(model, tokens)
        ablation.order_ablation(model, tokens, clean=clean)
        ablation.head_ablations(model, tokens, heads, False, clean=clean)
        ablation.head_ablations(model, tokens, heads, True, clean=clean)

    assert counted(run) == ablation.cost(model, 8, 1, heads).flops
