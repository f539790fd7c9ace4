"""An MLP writer's token table (circuits/expert_circuits.py) against transformers' own modules, in float64.

For each family transformers writes here (Mixtral, OLMoE, gpt-oss with its biased, clamped experts, DeepSeek-V3 with
a dense first layer and shared experts), row t of expert e's table is computed by transformers: its embedding row t
through the layer's post_attention_layernorm, its experts module run with every token sent to e at weight 1 (or its
shared or dense MLP), times lm_head. The router weights are transformers' router on the same input. The global
top-k of the factored table is checked against the dense table, and the price against torch's FLOP count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from circuits_core.circuits import expert_circuits as ec
from circuits_core.circuits.stream_components import parse_writer
from circuits_core.errors import InvalidInputError, NotFoundError
from circuits_core.formats.checkpoint import load_checkpoint
from tests.core.hf_families import VOCAB, hf_model, save
from tests.core.test_deepseek_hf import deepseek_model

F64 = torch.float64
BASE = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts_per_tok": 2, "max_position_embeddings": 64}  # fmt: skip
FAMILIES: dict[str, Any] = {
    "mixtral": lambda: hf_model("MixtralConfig", "MixtralForCausalLM",
                                {**BASE, "num_local_experts": 4, "intermediate_size": 24}, seed=41),
    "olmoe": lambda: hf_model("OlmoeConfig", "OlmoeForCausalLM",
                              {**BASE, "num_experts": 4, "intermediate_size": 24, "norm_topk_prob": False}, seed=42),
    "gpt-oss": lambda: hf_model("GptOssConfig", "GptOssForCausalLM",
                                {**BASE, "num_local_experts": 4, "intermediate_size": 24, "head_dim": 8,
                                 "sliding_window": 32}, seed=43),
    "deepseek-v3": lambda: deepseek_model("v3"),
}  # fmt: skip
TOKENS = torch.tensor([0, 3, 7, 19, 33, 60])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """name -> (transformers' model in float64, qkov's model of the saved files, unprocessed, float64)."""
    root = tmp_path_factory.mktemp("expert_tables")
    out = {}
    for name, build in FAMILIES.items():
        hf = build()
        hf.config._experts_implementation = "eager"  # transformers' own loop (its grouped kernel has no float64)
        folder = save(hf, Path(root / name))
        out[name] = (hf.double(), load_checkpoint(folder, dtype=F64, process=False).model)
    return out


def _mlp_input(hf: Any, layer: int, tokens: torch.Tensor) -> torch.Tensor:
    """post_attention_layernorm's RMS norm of the embedding rows [n, d], written out in float64 (transformers' own
    module computes it in float32)."""
    norm = hf.model.layers[layer].post_attention_layernorm
    x = hf.model.embed_tokens.weight[tokens].detach()
    return x * (x.square().mean(-1, keepdim=True) + norm.variance_epsilon).rsqrt() * norm.weight.detach()


def _hf_rows(hf: Any, layer: int, expert: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers: expert(post_attention_layernorm(embed(t))) @ lm_head^T, [n, V]; expert 'e<i>', 'shared' or ''."""
    block = hf.model.layers[layer]
    x = _mlp_input(hf, layer, tokens)  # [n, d]
    mlp = block.mlp
    with torch.no_grad():
        if expert == "shared":
            out = mlp.shared_experts(x)
        elif expert == "":
            out = mlp(x[None])[0]
        else:
            index = torch.full((len(tokens), 1), int(expert[1:]))
            out = mlp.experts(x, index, torch.ones(len(tokens), 1, dtype=F64))
        return hf.lm_head(out)


def _hf_route(hf: Any, layer: int, e: int, tokens: torch.Tensor) -> torch.Tensor:
    block = hf.model.layers[layer]
    x = _mlp_input(hf, layer, tokens)
    router = getattr(block.mlp, "gate", None) or block.mlp.router
    with torch.no_grad():
        _, weights, indices = router(x)
    return (weights * (indices == e)).sum(-1)


WRITERS = [("mixtral", "L1.mlp.e2"), ("olmoe", "L0.mlp.e3"), ("gpt-oss", "L1.mlp.e1"), ("deepseek-v3", "L2.mlp.e5"),
           ("deepseek-v3", "L1.mlp.shared"), ("deepseek-v3", "L0.mlp")]  # fmt: skip


@pytest.mark.parametrize(("name", "writer_name"), WRITERS)
def test_rows_equal_transformers_expert_on_the_embedding(world: dict[str, Any], name: str, writer_name: str) -> None:
    hf, model = world[name]
    writer = parse_writer(model, writer_name)
    expert = writer_name.split(".mlp")[1].lstrip(".")
    expected = _hf_rows(hf, writer.layer, expert, TOKENS)  # [n, V]
    with torch.no_grad():
        table = ec.full_expert_circuit(model, writer, TOKENS)  # [n, n] of the tokens
        whole = ec.full_expert_circuit(model, writer).AB  # [V, V], every token's rows in chunks
        row = ec.expert_row(model, writer, int(TOKENS[2]))
    assert expected.abs().max() > 0.1
    assert (table.AB - expected[:, TOKENS]).abs().max() < 1e-12
    assert (whole[TOKENS] - expected).abs().max() < 1e-12 and whole.shape == (VOCAB, VOCAB)
    assert (row - expected[2]).abs().max() < 1e-12
    values, rows, cols = table.topk_global(5)
    dense = expected[:, TOKENS]
    assert torch.allclose(values, dense.flatten().topk(5).values, atol=1e-12)
    assert torch.allclose(dense[rows, cols], values, atol=1e-12)


@pytest.mark.parametrize(("name", "writer_name"), WRITERS)
def test_route_weights_equal_transformers_router(world: dict[str, Any], name: str, writer_name: str) -> None:
    hf, model = world[name]
    writer = parse_writer(model, writer_name)
    every = torch.arange(VOCAB)
    with torch.no_grad():
        weights = ec.direct_route_weights(model, writer, every)
    if writer.expert < 0:  # dense and shared: always on
        assert torch.equal(weights, torch.ones_like(weights))
        return
    expected = _hf_route(hf, writer.layer, writer.expert, every)  # (its routers' softmax runs in float32)
    assert (weights - expected).abs().max() < 1e-6
    assert (weights == 0).any() and (weights > 0.05).any()  # some tokens alone choose the expert, some do not


def test_a_wrong_expert_breaks_the_match(world: dict[str, Any]) -> None:
    """The comparison above can fail: expert 2's table is not expert 1's."""
    hf, model = world["mixtral"]
    table = ec.full_expert_circuit(model, parse_writer(model, "L1.mlp.e1"), TOKENS).AB
    assert (table - _hf_rows(hf, 1, "e2", TOKENS)[:, TOKENS]).abs().max() > 1e-3


@pytest.mark.parametrize(("name", "writer_name"), WRITERS)
def test_the_price_counts_what_torch_counts(world: dict[str, Any], name: str, writer_name: str) -> None:
    _, model = world[name]
    writer = parse_writer(model, writer_name)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        table = ec.full_expert_circuit(model, writer, TOKENS)
        ec.direct_route_weights(model, writer, TOKENS)
    assert counter.get_total_flops() == ec.expert_rows_flops(model, writer, len(TOKENS)) + ec.route_flops(
        model, writer, len(TOKENS)
    )
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        ec.expert_row(model, writer, 4)
        ec.direct_route_weights(model, writer, TOKENS[:1])
    cost = ec.expert_table_cost(model, writer, k=5, budget_bytes=1 << 20, line=True)
    assert counter.get_total_flops() == cost.flops
    assert table.A.shape == (len(TOKENS), model.cfg.d_model)


def test_writers_without_a_table_are_refused(world: dict[str, Any]) -> None:
    _, model = world["mixtral"]
    with pytest.raises(InvalidInputError, match="not an MLP writer"):
        ec.full_expert_circuit(model, parse_writer(model, "L0H1"), TOKENS)
    with pytest.raises(InvalidInputError, match="whole expert"):
        ec.full_expert_circuit(model, parse_writer(model, "L0.mlp.e1[2,3]"), TOKENS)
    with pytest.raises(NotFoundError, match="4 experts"):
        parse_writer(model, "L0.mlp.e7")
