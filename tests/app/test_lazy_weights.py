"""Serving a Llama-family model whose MLP weights are read on first use (formats/lazy_mlp.py), through HTTP.

A checkpoint transformers writes is served with a model budget (max_model_bytes) that holds the attention,
norm, embedding and unembedding weights but not the MLPs too. Each analysis declared `weights="attention"` runs
and leaves every MLP weight unread (the model page's `computed_on` says so, and the engine's placeholders are
still meta); an analysis that reads the MLPs (the detectors run the model) is refused before it runs, with a 422
naming what it would load and the budget; with a budget that holds everything it runs and the MLPs are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers
from fastapi.testclient import TestClient

from app.catalog import ANALYSES
from app.main import create_app
from app.settings import Settings
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.lazy_mlp import weight_bytes
from tests.app.conftest import LIMITS, assert_problem
from tests.app.test_device_clean import PATH_VALUES, QUERY_VALUES

CONFIG = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}  # fmt: skip
ATTENTION_ONLY = [a for a in ANALYSES if a.scope == "model" and a.weights == "attention"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lazy-app")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(root / "llama")
    (root / "shipped").mkdir()
    return root


def client(models_dir: Path, max_model_bytes: int) -> TestClient:
    settings = Settings(
        shipped_dir=models_dir / "shipped", models_dir=models_dir, limits=LIMITS, max_model_bytes=max_model_bytes,
        device="cpu",
    )  # fmt: skip
    return TestClient(create_app(settings))


def request(analysis: Any) -> tuple[str, dict[str, Any]]:
    path = analysis.api_path.replace("{model}", "llama")
    for name in analysis.path_fields():
        path = path.replace("{" + name + "}", PATH_VALUES[name])
    query = {k: v for k, v in QUERY_VALUES.items() if k in analysis.params.model_fields}
    return path, {k: v for k, v in query.items() if "{" + k + "}" not in analysis.path}


def test_weight_circuits_never_read_the_mlp_and_the_rest_is_priced_first(models_dir: Path) -> None:
    model = load_checkpoint(models_dir / "llama", lazy_mlp=True).model
    resident, deferred = weight_bytes(model, False), weight_bytes(model, True)
    assert deferred > 0
    with client(models_dir, resident + deferred // 2) as c:
        assert c.get("/api/v1/models/llama").json()["computed_on"] == {
            "device": "cpu", "weights_dtype": "float32", "compute_dtype": "float32",
            "mlp_weights": "deferred in 2 of 2 layers",
        }  # fmt: skip
        for analysis in ATTENTION_ONLY:
            path, query = request(analysis)
            answer = c.get(path, params=query)
            assert answer.status_code == 200, (analysis.name, answer.text)
        assert c.app.state.registry.get("llama").provenance()["mlp_weights"] == "deferred in 2 of 2 layers"  # type: ignore[attr-defined]
        refused = c.get("/api/v1/models/llama/detectors", params={"seq_len": 5, "batch": 2})
        assert_problem(refused, 422, "MLP weights", "would load", "max_model_bytes")
    with client(models_dir, resident + deferred) as c:
        assert c.get("/api/v1/models/llama/detectors", params={"seq_len": 5, "batch": 2}).status_code == 200
        assert c.get("/api/v1/models/llama").json()["computed_on"]["mlp_weights"] == "read"
