"""The walk of every analysis endpoint and page over tiny checkpoints that transformers writes, served as a user
would serve them (a Hugging Face folder, or a GGUF file as llama.cpp's converter writes it, with a tokenizer.json
next to it): shared by the families beyond Llama (tests/app/test_families_app.py) and DeepSeek's
(tests/app/test_deepseek_app.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.app.conftest import LIMITS, train_tokenizer
from tests.app.test_pages import PAGES
from tests.app.test_pricing import NEEDS_AN_INDUCTION_HEAD, QUERY_VALUES, _request
from tests.core.hf_families import hf_model

Family = tuple[str, str, dict[str, Any]]  # transformers' config class, model class, config fields


def family_app(
    root: Path, families: dict[str, Family], seed: int = 3, gguf: dict[str, Callable[[Any, Path], None]] | None = None
) -> tuple[FastAPI, dict[str, Any]]:
    """The app serving each family's random checkpoint from `root` (float64, the tests' LIMITS), and transformers'
    models themselves, the reference the views are checked against. `gguf`: the families written as a GGUF file
    instead of save_pretrained's folder, each by its writer (model, path of the .gguf)."""
    tok = train_tokenizer()
    references = {}
    for name, (config_cls, model_cls, fields) in families.items():
        model = hf_model(config_cls, model_cls, {**fields, "vocab_size": tok.get_vocab_size()}, seed=seed)
        write = (gguf or {}).get(name)
        if write is None:
            model.save_pretrained(root / name)
        else:
            (root / name).mkdir()
            write(model, root / name / "model.gguf")
        (root / name / "tokenizer.json").write_text(tok.to_str())
        references[name] = model
    (root / "shipped").mkdir()
    settings = Settings(shipped_dir=root / "shipped", models_dir=root, dtype="float64", limits=LIMITS)
    return create_app(settings), references


def model_analyses(client: TestClient) -> list[Any]:
    return [a for a in client.app.state.analyses.analyses if a.scope == "model"]  # type: ignore[attr-defined]


def endpoint_failures(client: TestClient, model: str, refused: dict[str, str] | None = None) -> list[str]:
    """Every model analysis's endpoint on `model` with the walk's values (test_pricing._request): what did not answer
    200. A random model has no induction head, and `refused` names analyses the model may refuse with a 422 whose
    detail says the given words (why it cannot answer them)."""
    listed = {m["id"] for m in client.get("/api/v1/models").json()}
    assert model in listed, listed
    refused = {**{name: "no induction head" for name in NEEDS_AN_INDUCTION_HEAD}, **(refused or {})}
    failures = []
    for analysis in model_analyses(client):
        path, query = _request(analysis)
        path = path.replace("/tiny-2l", f"/{model}")
        answer = client.get(path, params={**query, **({"tokens": QUERY_VALUES["tokens"]} if "tokens" in query else {})})
        if analysis.name in refused and answer.status_code == 422:
            assert refused[analysis.name] in answer.json()["detail"], (analysis.name, answer.text)
        elif answer.status_code != 200:
            failures.append(f"{analysis.name}: {answer.status_code} {answer.text[:300]}")
    return failures


def page_failures(client: TestClient, model: str) -> list[str]:
    """Every page of tests/app/test_pages.py's walk on `model`: what did not answer 200."""
    failures = []
    for page, _ in PAGES:
        url = page.replace("tiny-2l", model)
        answer = client.get(url)
        if answer.status_code != 200:
            failures.append(f"{url}: {answer.status_code} {answer.text[:300]}")
    return failures
