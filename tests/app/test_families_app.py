"""Every analysis endpoint and page answers on tiny checkpoints of the families beyond Llama, written by
transformers (gpt-oss: sinks, mixture of experts, YaRN; Mixtral, Qwen3-MoE, OLMoE; BLOOM, MPT; Phi-3), served as a
user would serve them: a Hugging Face
folder with a tokenizer.json next to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.app.conftest import LIMITS, train_tokenizer
from tests.app.test_pages import DECLARED_PAGES, PAGES
from tests.app.test_pricing import NEEDS_AN_INDUCTION_HEAD, QUERY_VALUES, _request
from tests.core.hf_families import hf_model

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
# Rotary-only analyses: an ALiBi model answers its positional kernel and refuses these, saying why (422).
ROTARY_ONLY = {"rotary-bands", "composition-profile", "qk-copying-offset"}


@pytest.fixture(scope="module")
def family_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    root = tmp_path_factory.mktemp("families")
    tok = train_tokenizer()
    references = {}
    for name, (config_cls, model_cls, fields) in FAMILIES.items():
        model = hf_model(config_cls, model_cls, {**fields, "vocab_size": tok.get_vocab_size()}, seed=3)
        model.save_pretrained(root / name)
        (root / name / "tokenizer.json").write_text(tok.to_str())
        references[name] = model
    (root / "shipped").mkdir()
    settings = Settings(shipped_dir=root / "shipped", models_dir=root, dtype="float64", limits=LIMITS)
    app = create_app(settings)
    app.state.families_hf = references  # transformers' models, the reference the views are checked against
    with TestClient(app) as client:
        yield client


def _analyses(client: TestClient) -> list[Any]:
    return [a for a in client.app.state.analyses.analyses if a.scope == "model"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_analysis_endpoint_answers(family_client: TestClient, model: str) -> None:
    listed = {m["id"] for m in family_client.get("/api/v1/models").json()}
    assert model in listed, listed
    failures = []
    for analysis in _analyses(family_client):
        path, query = _request(analysis)
        path = path.replace("/tiny-2l", f"/{model}")
        answer = family_client.get(
            path, params={**query, **({"tokens": QUERY_VALUES["tokens"]} if "tokens" in query else {})}
        )
        if analysis.name in NEEDS_AN_INDUCTION_HEAD and answer.status_code == 422:
            assert "no induction head" in answer.json()["detail"]  # a random model has none: refused, saying why
        elif analysis.name in ROTARY_ONLY and model in ("tiny-bloom", "tiny-mpt") and answer.status_code == 422:
            assert "rotary" in answer.json()["detail"]
        elif answer.status_code != 200:
            failures.append(f"{analysis.name}: {answer.status_code} {answer.text[:200]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_page_answers(family_client: TestClient, model: str) -> None:
    failures = []
    for page in [p for p, _ in PAGES] + DECLARED_PAGES:
        url = page.replace("tiny-2l", model)
        answer = family_client.get(url)
        if answer.status_code != 200:
            failures.append(f"{url}: {answer.status_code} {answer.text[:300]}")
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
