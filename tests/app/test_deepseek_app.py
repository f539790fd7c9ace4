"""Every analysis endpoint and page answers on tiny DeepSeek-V3 and DeepSeek-V2-Lite checkpoints written by
transformers (multi-head latent attention, dense first layer, routed and shared experts), served as a user would
serve them: a Hugging Face folder with a tokenizer.json next to it; the head page names the two QK terms, OV through
the latent and the shared latent subspace composition reads, with numbers checked against transformers' weights."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tests.app.family_walk import endpoint_failures, family_app, page_failures

SMALL = {
    "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 16,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
    "kv_lora_rank": 12, "qk_rope_head_dim": 4, "v_head_dim": 6, "qk_nope_head_dim": 8, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
}  # fmt: skip
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**SMALL, "q_lora_rank": 10, "n_group": 2,
                                                                        "topk_group": 1}),
    "tiny-deepseek-v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**SMALL, "q_lora_rank": None}),
}  # fmt: skip


@pytest.fixture(scope="module")
def mla_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    app, references = family_app(tmp_path_factory.mktemp("deepseek"), FAMILIES)
    app.state.deepseek_hf = references
    with TestClient(app, raise_server_exceptions=False) as client:  # a 5xx is a failure listed, not a crash
        yield client


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_analysis_endpoint_answers(mla_client: TestClient, model: str) -> None:
    failures = endpoint_failures(mla_client, model)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_page_answers(mla_client: TestClient, model: str) -> None:
    failures = page_failures(mla_client, model)
    assert not failures, "\n".join(failures)


def _dense_terms(hf: Any, layer: int, h: int) -> tuple[float, float, float, float]:
    """‖A_h‖, ‖C_h‖, ‖D‖, ‖OV_h‖ from transformers' own module weights, with the served model's processing (the ln1
    gain folded into the projections that read the stream)."""
    cfg, attn = hf.config, hf.model.layers[layer].self_attn
    w = hf.model.layers[layer].input_layernorm.weight.detach().double()[:, None]  # [d, 1]
    H, nope, rope, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                            cfg.kv_lora_rank)  # fmt: skip
    if cfg.q_lora_rank is None:
        read_q, up_q = w * torch.eye(cfg.hidden_size, dtype=torch.float64), attn.q_proj.weight
    else:
        read_q = w * attn.q_a_proj.weight.detach().double().T * attn.q_a_layernorm.weight.detach().double()
        up_q = attn.q_b_proj.weight
    up_q = up_q.detach().double().view(H, nope + rope, -1)[h]  # [nope + rope, q_rank]
    down = attn.kv_a_proj_with_mqa.weight.detach().double()
    read_kv = w * down[:r].T * attn.kv_a_layernorm.weight.detach().double()  # [d, r]
    kv_up = attn.kv_b_proj.weight.detach().double().view(H, nope + dv, r)[h]
    out = attn.o_proj.weight.detach().double().T.reshape(H, dv, -1)[h]
    content = read_q @ up_q[:nope].T @ (read_kv @ kv_up[:nope].T).T
    ov = read_kv @ kv_up[nope:].T @ out
    norm = torch.linalg.matrix_norm
    return (float(norm(content)), float(norm(read_q @ up_q[nope:].T)), float(norm(w * down[r:].T)), float(norm(ov)))


@pytest.mark.parametrize("model", list(FAMILIES))
def test_head_page_names_the_latent_terms(mla_client: TestClient, model: str) -> None:
    import re

    hf = mla_client.app.state.deepseek_hf[model]  # type: ignore[attr-defined]
    page = mla_client.get(f"/models/{model}/heads/L1H2").text
    assert 'id="latent-terms"' in page and "content term A_h" in page and "rotary term C_h R(δ) Dᵀ" in page
    assert "Composition into this head reads the shared latent subspace" in page
    assert "QK form: latent-token" in page and "Latent attention: μ carries its own latent scales" in page
    shown = [
        float(re.search(rf'id="{key}">([^<]+)<', page).group(1))  # type: ignore[union-attr]
        for key in ("latent-content-norm", "latent-query-rotary-norm", "latent-key-rotary-norm", "latent-ov-norm")
    ]
    body = mla_client.get(f"/api/v1/models/{model}/heads/L1H2").json()["latent"]  # the page's JSON twin
    keys = ("content_norm", "query_rotary_norm", "key_rotary_norm", "ov_norm")
    for got, json_value, want in zip(shown, [body[k] for k in keys], _dense_terms(hf, 1, 2), strict=True):
        assert got == pytest.approx(want, rel=1e-3) and json_value == pytest.approx(want, rel=1e-9)
    assert body["kv_rank"] == hf.config.kv_lora_rank and body["rotary_rank_bound"] == hf.config.qk_rope_head_dim
    dense_page = mla_client.get(f"/models/{model}/heads/L0H0").text
    assert 'id="latent-terms"' in dense_page  # every layer has latent attention (layer 0's MLP is the dense one)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_composition_page_says_composition_reads_the_shared_latent(mla_client: TestClient, model: str) -> None:
    hf = mla_client.app.state.deepseek_hf[model]  # type: ignore[attr-defined]
    page = mla_client.get(f"/models/{model}/composition", params={"kind": "K"}).text
    assert 'id="latent-composition"' in page and "reads the shared latent subspace" in page
    assert f"(rank {hf.config.kv_lora_rank})" in page and "QK form: latent-bilinear" in page


@pytest.mark.parametrize("model", list(FAMILIES))
def test_qk_view_splits_each_entry_into_content_and_rotary(mla_client: TestClient, model: str) -> None:
    """Each listed entry's content + rotary terms equal its value; the content term does not move with δ while the
    rotary term does; and the value is the score the served model's layer 0 gives the pair (a forward pass)."""
    registry = mla_client.app.state.registry  # type: ignore[attr-defined]
    served = registry.get(model).model
    bodies = {
        d: mla_client.get(f"/api/v1/models/{model}/heads/L0H1/qk", params={"k": 5, "offset": d}).json() for d in (1, 3)
    }
    for delta, body in bodies.items():
        assert body["qk_form"] == "latent-token"
        for e, c, r in zip(body["entries"], body["latent_content"], body["latent_rotary"], strict=True):
            assert c + r == pytest.approx(e["value"], abs=1e-9)
            seq = torch.tensor([[e["col"]["id"]] + [0] * (delta - 1) + [e["row"]["id"]]])
            _, cache = served.run(seq, names={"blocks.0.attn.hook_attn_scores"})
            assert e["value"] == pytest.approx(float(cache["blocks.0.attn.hook_attn_scores"][0, 1, delta, 0]), abs=1e-9)
    first = bodies[1]["entries"][0]
    again = mla_client.get(
        f"/api/v1/models/{model}/heads/L0H1/qk", params={"token": first["row"]["id"], "k": 50, "offset": 3}
    ).json()
    match = [i for i, e in enumerate(again["entries"]) if e["col"]["id"] == first["col"]["id"]]
    assert match  # the same pair at δ = 3: the same content term, another rotary term
    assert again["latent_content"][match[0]] == pytest.approx(bodies[1]["latent_content"][0], abs=1e-9)
    assert again["latent_rotary"][match[0]] != pytest.approx(bodies[1]["latent_rotary"][0], abs=1e-9)
    page = mla_client.get(f"/models/{model}/heads/L0H1", params={"offset": 1}).text
    assert "Content + rotary terms of the values listed" in page
