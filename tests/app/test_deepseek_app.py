"""Every analysis endpoint and page answers on tiny DeepSeek-V3 and DeepSeek-V2-Lite checkpoints written by
transformers (multi-head latent attention, dense first layer, routed and shared experts), served as a user would
serve them: a Hugging Face folder with a tokenizer.json next to it. An analysis that cannot apply to multi-head
latent attention answers 422 saying why; nothing answers 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.app.conftest import LIMITS, train_tokenizer
from tests.app.test_families_app import _analyses
from tests.app.test_pages import PAGES
from tests.app.test_pricing import NEEDS_AN_INDUCTION_HEAD, QUERY_VALUES, _request
from tests.core.hf_families import hf_model

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
# What multi-head latent attention refuses, saying why (422): analysis name -> words the refusal contains.
MLA_REFUSED: dict[str, str] = {}


@pytest.fixture(scope="module")
def mla_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    root = tmp_path_factory.mktemp("deepseek")
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
    app.state.deepseek_hf = references
    with TestClient(app, raise_server_exceptions=False) as client:  # a 5xx is a failure listed, not a crash
        yield client


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_analysis_endpoint_answers(mla_client: TestClient, model: str) -> None:
    listed = {m["id"] for m in mla_client.get("/api/v1/models").json()}
    assert model in listed, listed
    failures = []
    for analysis in _analyses(mla_client):
        path, query = _request(analysis)
        path = path.replace("/tiny-2l", f"/{model}")
        answer = mla_client.get(
            path, params={**query, **({"tokens": QUERY_VALUES["tokens"]} if "tokens" in query else {})}
        )
        if analysis.name in NEEDS_AN_INDUCTION_HEAD and answer.status_code == 422:
            assert "no induction head" in answer.json()["detail"]
        elif analysis.name in MLA_REFUSED and answer.status_code == 422:
            assert MLA_REFUSED[analysis.name] in answer.json()["detail"]
        elif answer.status_code != 200:
            failures.append(f"{analysis.name}: {answer.status_code} {answer.text[:300]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_page_answers(mla_client: TestClient, model: str) -> None:
    failures = []
    for page, _ in PAGES:
        url = page.replace("tiny-2l", model)
        answer = mla_client.get(url)
        if answer.status_code >= 500 or (answer.status_code != 200 and "latent" not in answer.text):
            failures.append(f"{url}: {answer.status_code} {answer.text[:300]}")
    assert not failures, "\n".join(failures)
