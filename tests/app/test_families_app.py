"""Every analysis endpoint and page answers on tiny checkpoints of the families beyond Llama, written by
transformers (gpt-oss: sinks, mixture of experts, YaRN; Mixtral, Qwen3-MoE, OLMoE; BLOOM, MPT; Phi-3; DeepSeek-V3),
served as a user would serve them: a Hugging Face folder with a tokenizer.json next to it, and each family again as
the GGUF file llama.cpp's converter writes (gpt-oss's experts in MXFP4, as released), the tokenizer.json beside it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import pytest
import torch
from fastapi.testclient import TestClient

from tests.app.conftest import LIMITS
from tests.app.family_walk import endpoint_failures, family_app, page_failures
from tests.app.test_deepseek_app import FAMILIES as DEEPSEEK_FAMILIES
from tests.core.gguf_writing import write_bloom, write_deepseek, write_gguf, write_mpt
from tests.core.test_gguf_phi3 import write_phi3

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 32, "head_dim": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
        "sliding_window": 32, "rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 16}}),
    "tiny-mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 24, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}),
    "tiny-qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_hidden_layers": 2, "hidden_size": 32, "moe_intermediate_size": 24, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
        "head_dim": 8}),
    "tiny-olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 24, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}),
    "tiny-bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 24, "n_head": 6, "n_layer": 2}),
    "tiny-mpt": ("MptConfig", "MptForCausalLM", {"d_model": 24, "n_heads": 6, "n_layers": 2, "max_seq_len": 64}),
    "tiny-phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": None, "eos_token_id": None,
        "bos_token_id": None}),
}  # fmt: skip
SHIPPED_AS = {  # the GGUF families: writer (model, path) from the GGUF loader tests, and the family written
    "gguf-gpt-oss": (lambda m, p: write_gguf(m, "gpt-oss", p, expert_type=gguf.GGMLQuantizationType.MXFP4),
                     "tiny-gpt-oss"),
    "gguf-mixtral": (lambda m, p: write_gguf(m, "llama", p), "tiny-mixtral"),
    "gguf-qwen3-moe": (lambda m, p: write_gguf(m, "qwen3moe", p), "tiny-qwen3-moe"),
    "gguf-olmoe": (lambda m, p: write_gguf(m, "olmoe", p), "tiny-olmoe"),
    "gguf-bloom": (write_bloom, "tiny-bloom"), "gguf-mpt": (write_mpt, "tiny-mpt"),
    "gguf-phi3": (write_phi3, "tiny-phi3"),
    "gguf-deepseek-v3": (lambda m, p: write_deepseek(m, p, "sigmoid", legacy=False), "tiny-deepseek-v3"),
}  # fmt: skip
FAMILIES |= {name: (DEEPSEEK_FAMILIES | FAMILIES)[family] for name, (_, family) in SHIPPED_AS.items()}
ALIBI = ("tiny-bloom", "tiny-mpt", "gguf-bloom", "gguf-mpt")
# Rotary-only analyses: an ALiBi model answers its positional kernel and refuses these, saying why (422).
ROTARY_ONLY = {"rotary-bands", "composition-profile", "qk-copying-offset"}


@pytest.fixture(scope="module")
def family_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    gguf_writers = {name: write for name, (write, _) in SHIPPED_AS.items()}
    app, references = family_app(tmp_path_factory.mktemp("families"), FAMILIES, gguf=gguf_writers)
    app.state.families_hf = references  # transformers' models, the reference the views are checked against
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_analysis_endpoint_answers(family_client: TestClient, model: str) -> None:
    alibi = model in ALIBI
    if model in SHIPPED_AS:  # served from the GGUF file
        assert {m["id"]: m["format"] for m in family_client.get("/api/v1/models").json()}[model] == "gguf"
    failures = endpoint_failures(family_client, model, {name: "rotary" for name in ROTARY_ONLY} if alibi else {})
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_page_answers(family_client: TestClient, model: str) -> None:
    failures = page_failures(family_client, model)
    assert not failures, "\n".join(failures)


def test_qk_view_shows_which_pairs_beat_the_sink(family_client: TestClient) -> None:
    """sink_attend of each listed pair at offset 1 against transformers' own eager pattern on the sequence [key, query]:
    layer 0 sees the embeddings, so sigma(s_10 - b_h) = p_10 / (p_10 + p_sink), p_sink = 1 - p_10 - p_11."""
    import torch

    hf = family_client.app.state.families_hf["tiny-gpt-oss"]  # type: ignore[attr-defined]
    body = family_client.get("/api/v1/models/tiny-gpt-oss/heads/L0H1/qk", params={"k": 6, "offset": 1}).json()
    assert body["sink_logit"] == pytest.approx(float(hf.model.layers[0].self_attn.sinks[1].detach()), abs=1e-6)
    assert len(body["sink_attend"]) == len(body["entries"]) == 6
    for entry, attend in zip(body["entries"], body["sink_attend"], strict=True):
        with torch.no_grad():
            p = hf(torch.tensor([[entry["col"]["id"], entry["row"]["id"]]]), output_attentions=True).attentions[0]
        p10, p11 = float(p[0, 1, 1, 0]), float(p[0, 1, 1, 1])
        assert attend == pytest.approx(p10 / (1 - p11), abs=1e-5)
    page = family_client.get("/models/tiny-gpt-oss/heads/L0H1?offset=1").text
    assert "Learned sink b = " in page and "pairs listed beat the sink" in page


def test_prompt_view_shows_the_sink_mass(family_client: TestClient) -> None:
    import torch

    hf = family_client.app.state.families_hf["tiny-gpt-oss"]  # type: ignore[attr-defined]
    body = family_client.get("/api/v1/models/tiny-gpt-oss/prompt", params={"tokens": "5,6,7,8", "heads": "L1H2"}).json()
    with torch.no_grad():
        ref = hf(torch.tensor([[5, 6, 7, 8]]), output_attentions=True).attentions[1][0, 2]
    assert body["heads"][0]["sink_mass"] == pytest.approx((1 - ref.sum(-1)).tolist(), abs=1e-5)
    page = family_client.get("/models/tiny-gpt-oss/prompt", params={"tokens": "5,6,7,8", "heads": "L1H2"}).text
    assert 'id="sink-mass"' in page


@pytest.mark.parametrize("model", ["tiny-bloom", "tiny-mpt"])
def test_alibi_positional_kernel_is_the_content_constant_minus_the_slope(family_client: TestClient, model: str) -> None:
    """f(δ) = c - m_h δ exactly: the differences between offsets are -m_h, with m_h by transformers' own slope
    function (BLOOM's and MPT's agree at MPT's default alibi_bias_max)."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    body = family_client.get(f"/api/v1/models/{model}/heads/L1H4/positional", params={"max_offset": 6}).json()
    kernel = body["kernel"]
    slope = float(_get_alibi_slopes(6, torch.device("cpu"))[4])
    steps = [b - a for a, b in zip(kernel, kernel[1:], strict=False)]
    assert steps == pytest.approx([-slope] * 6, abs=1e-6) and body["peak_offset"] == 0
    assert "ALiBi" in body["basis"]


@pytest.mark.parametrize(
    ("model", "mlp", "token"), [("tiny-mixtral", "L1.mlp.e2", 7), ("tiny-gpt-oss", "L0.mlp.e3", 11)]
)
def test_expert_table_is_transformers_expert_on_the_embedding(
    family_client: TestClient, model: str, mlp: str, token: int
) -> None:
    """The expert-ov endpoint on the stored weights (basis=raw): a token's row and the global table's entries equal
    transformers' experts module on the token's normalised embedding then lm_head; each entry's router weight equals
    transformers' router on the same input; the page shows the values and says the form."""
    hf = family_client.app.state.families_hf[model]  # type: ignore[attr-defined]
    layer, expert = int(mlp[1]), int(mlp.split(".e")[1])
    block = hf.model.layers[layer]
    norm = block.post_attention_layernorm
    W_E = hf.model.embed_tokens.weight.detach().double()
    x = W_E * (W_E.square().mean(-1, keepdim=True) + norm.variance_epsilon).rsqrt() * norm.weight.detach().double()
    hf.config._experts_implementation = "eager"  # transformers' own loop (its grouped kernel has no float64)
    experts, router = block.mlp.experts.double(), (getattr(block.mlp, "gate", None) or block.mlp.router).double()
    with torch.no_grad():
        table = hf.lm_head.double()(experts(x, torch.full((len(x), 1), expert), torch.ones(len(x), 1, dtype=x.dtype)))
        _, weights, indices = router(x)
    route = (weights * (indices == expert)).sum(-1)
    body = family_client.get(f"/api/v1/models/{model}/expert-ov", params={"mlp": mlp, "k": 6, "basis": "raw"}).json()
    assert body["mlp"] == mlp and body["circuit"] == "expert" and "not linearised" in body["form_note"]
    values = [e["value"] for e in body["entries"]]
    assert values == pytest.approx(table.flatten().topk(6).values.tolist(), abs=1e-9)
    for entry, weight in zip(body["entries"], body["route_weight"], strict=True):
        assert entry["value"] == pytest.approx(float(table[entry["row"]["id"], entry["col"]["id"]]), abs=1e-9)
        assert weight == pytest.approx(float(route[entry["row"]["id"]]), abs=1e-6)
    row = family_client.get(
        f"/api/v1/models/{model}/expert-ov", params={"mlp": mlp, "token": str(token), "k": 4, "basis": "raw"}
    ).json()
    assert [e["value"] for e in row["entries"]] == pytest.approx(table[token].topk(4).values.tolist(), abs=1e-9)
    page = family_client.get(f"/models/{model}/expert-ov", params={"mlp": mlp, "k": 6, "basis": "raw"}).text
    assert 'id="expert-table"' in page and f"{values[0]:.3f}" in page and "not linearised" in page


def test_expert_table_refuses_what_is_not_a_whole_mlp_writer(family_client: TestClient) -> None:
    url = "/api/v1/models/tiny-mixtral/expert-ov"
    refused = (("L0H1", "not a whole MLP writer"), ("L0.mlp", "mixture of 4 experts"), ("L0.mlp.e9", "4 experts"),
               ("L0.mlp.e1[2]", "not a whole MLP writer"), ("L5.mlp.e0", "2 layers"))  # fmt: skip
    for mlp, words in refused:
        answer = family_client.get(url, params={"mlp": mlp})
        assert 400 <= answer.status_code < 500 and words in answer.json()["detail"], (mlp, answer.text)
    dense = family_client.get("/api/v1/models/tiny-phi3/expert-ov").json()  # a dense model: its first MLP
    assert dense["mlp"] == "L0.mlp" and dense["route_weight"] == [1.0] * len(dense["entries"])


@pytest.mark.parametrize("params", [{}, {"mlp": "L1.mlp.e1", "token": "9", "k": 5}, {"vocab": "all", "k": 3}])
def test_expert_table_price_bounds_its_answer(family_client: TestClient, params: dict[str, Any]) -> None:
    """As tests/app/test_pricing.py checks every analysis on tiny-2l (attention-only: this one is refused there): the
    encoded answer is no larger than priced, and not far below it."""
    from app.views.experts import EXPERT_OV

    app = family_client.app
    answer = family_client.get("/api/v1/models/tiny-olmoe/expert-ov", params=params)
    assert answer.status_code == 200, answer.text
    loaded = app.state.registry.get("tiny-olmoe")  # type: ignore[attr-defined]
    bound = app.state.analyses.bound(EXPERT_OV)  # type: ignore[attr-defined]
    cost = EXPERT_OV.cost(loaded, bound.model_validate(params).normalised(loaded), LIMITS)
    real = len(answer.content)
    assert real <= cost.answer_bytes <= 16 * real + 16384, (real, cost.answer_bytes)
    assert cost.flops > 0
