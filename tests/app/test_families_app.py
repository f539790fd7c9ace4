"""Every analysis endpoint and page answers on tiny checkpoints of the families beyond Llama, written by
transformers (gpt-oss: sinks, mixture of experts, YaRN), served as a user would serve them: a Hugging Face
folder with a tokenizer.json next to it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.app.conftest import LIMITS, train_tokenizer
from tests.app.test_pages import PAGES
from tests.app.test_pricing import QUERY_VALUES, _request
from tests.core.hf_families import hf_model

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 32, "head_dim": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
        "sliding_window": 32, "rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 16}}),
}  # fmt: skip


@pytest.fixture(scope="module")
def family_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    root = tmp_path_factory.mktemp("families")
    tok = train_tokenizer()
    for name, (config_cls, model_cls, fields) in FAMILIES.items():
        model = hf_model(config_cls, model_cls, {**fields, "vocab_size": tok.get_vocab_size()}, seed=3)
        model.save_pretrained(root / name)
        (root / name / "tokenizer.json").write_text(tok.to_str())
    (root / "shipped").mkdir()
    settings = Settings(shipped_dir=root / "shipped", models_dir=root, dtype="float64", limits=LIMITS)
    with TestClient(create_app(settings)) as client:
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
        if answer.status_code != 200:
            failures.append(f"{analysis.name}: {answer.status_code} {answer.text[:200]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_page_answers(family_client: TestClient, model: str) -> None:
    failures = []
    for page, _ in PAGES:
        url = page.replace("tiny-2l", model)
        answer = family_client.get(url)
        if answer.status_code != 200:
            failures.append(f"{url}: {answer.status_code} {answer.text[:300]}")
    assert not failures, "\n".join(failures)
