"""Fixtures of the API tests: tiny random models saved in qkov format, an app built on them, a client.

Folders (session-scoped, built once):
  shipped/tiny-2l   2 layers x 4 heads, shortformer positions, no LayerNorm, BPE tokenizer (BOS <|endoftext|>),
                    token_counts.npy of seeded random counts (min_count works on it)
  user/tiny-ln      1 layer x 2 heads, standard positions, LayerNorm, n_ctx 32, same tokenizer
  user/broken       config.json + a weight file missing a tensor: listed as unavailable, 422 when used
  user/mamba        config.json of an unsupported architecture: listed as unavailable
  user/.hidden, user/empty   never models
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from safetensors.torch import save_file
from tokenizers import Tokenizer

from app.main import create_app
from app.settings import Limits, Settings
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from circuits_core.prompt.phenomena import TOKEN_COUNTS_FILE
from tests.bpe import train_bpe

TEXT = (
    "def add(self, name, value):\n    self.name = name\n    return value + 1\n"
    "for item in items:\n    print(item, name)\nclass Thing(object):\n    pass\n"
    "the cat sat on the mat while the dog ran to the park and the bird sang\n"
)


def train_tokenizer() -> Tokenizer:
    return train_bpe([TEXT] * 20, vocab_size=320)


CARD = {"summary": "tiny random model for the API tests", "facts": {"seed": 1}}


def save_qkov(
    folder: Path, cfg: ModelConfig, tok: Tokenizer, seed: int, drop: str | None = None, card: dict | None = None
) -> None:
    """qkov format written by hand: config.json (format qkov) + model.safetensors + tokenizer.json (+ card)."""
    folder.mkdir(parents=True)
    model = random_model(cfg, seed=seed, std_embed=0.5)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != drop}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"format": "qkov", **cfg.to_dict()}))
    (folder / "tokenizer.json").write_text(tok.to_str())
    if card is not None:
        (folder / "model_card.json").write_text(json.dumps(card))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qkov-models")
    tok = train_tokenizer()
    V = tok.get_vocab_size()
    shipped, user = root / "shipped", root / "user"
    two = ModelConfig(
        n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=V, n_ctx=128, positional_embedding_type="shortformer"
    )
    save_qkov(shipped / "tiny-2l", two, tok, seed=1, card=CARD)
    np.save(shipped / "tiny-2l" / TOKEN_COUNTS_FILE, np.random.default_rng(0).integers(0, 1000, V))
    ln = ModelConfig(
        n_layers=1,
        d_model=16,
        n_heads=2,
        d_head=8,
        d_vocab=V,
        n_ctx=32,
        positional_embedding_type="standard",
        normalization_type="LN",
    )
    save_qkov(user / "tiny-ln", ln, tok, seed=2)
    save_qkov(user / "broken", two, tok, seed=3, drop="blocks.1.attn.W_K")
    save_qkov(user / ".hidden", two, tok, seed=4)
    (user / "empty").mkdir()
    (user / "mamba").mkdir()
    (user / "mamba" / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    return shipped, user


LIMITS = Limits(max_prompt_tokens=40, max_k=50, max_heads=4, max_batch=8, max_seq_len=60, matrix_budget_bytes=64 * 1024)


@pytest.fixture(scope="session")
def settings(model_dirs: tuple[Path, Path]) -> Settings:
    shipped, user = model_dirs
    return Settings(shipped_dir=shipped, models_dir=user, dtype="float64", limits=LIMITS)


@pytest.fixture(scope="session")
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="session")
def tiny(model_dirs: tuple[Path, Path]) -> LoadedModel:
    """The same checkpoint the app serves as tiny-2l, loaded directly by the engine (float64)."""
    return load_checkpoint(model_dirs[0] / "tiny-2l", dtype=torch.float64)


@pytest.fixture(scope="session")
def tiny_ln(model_dirs: tuple[Path, Path]) -> LoadedModel:
    return load_checkpoint(model_dirs[1] / "tiny-ln", dtype=torch.float64)


def assert_problem(response, status: int, *needles: str) -> dict:
    """A problem+json refusal with the status and a detail mentioning every needle."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert {"type", "title", "status", "detail", "instance"} <= body.keys()
    assert body["status"] == status
    for needle in needles:
        assert needle.lower() in body["detail"].lower(), (needle, body["detail"])
    return body


def get_routes(app: FastAPI) -> list[tuple[str, bool]]:
    """(path, in the OpenAPI schema) of every GET route, included routers walked: FastAPI 0.16x keeps an included
    router's routes behind it, so `app.routes` alone lists only the app's own few."""

    def walk(items: list[Any], prefix: str = "") -> Iterator[tuple[str, bool]]:
        for r in items:
            if hasattr(r, "original_router"):
                yield from walk(r.original_router.routes, prefix + (getattr(r.include_context, "prefix", "") or ""))
            elif "GET" in (getattr(r, "methods", None) or ()):
                yield prefix + r.path, bool(getattr(r, "include_in_schema", False))

    return list(walk(app.router.routes))


def until_done(client, url: str, timeout: float = 900.0, **kwargs):
    """GET `url`; while it answers 202 (a long computation running as a job, app/scheduling/), poll its job until
    it is finished and ask again: the response once the answer exists (a page's job id is in its data-job)."""
    import re
    import time

    end = time.monotonic() + timeout
    while True:
        response = client.get(url, **kwargs)
        if response.status_code != 202:
            return response
        if response.headers.get("content-type", "").startswith("application/json"):
            job_id = response.json()["id"]
        else:
            found = re.search(r'data-job="([0-9a-f]+)"', response.text)
            assert found, f"a 202 page without a job: {response.text[:300]}"
            job_id = found.group(1)
        while True:
            assert time.monotonic() < end, f"{url}: job {job_id} did not finish in {timeout} s"
            state = client.get(f"/api/v1/jobs/{job_id}").json()
            if state.get("state") not in ("queued", "running"):
                break
            time.sleep(0.2)


def _limited_client(settings: Settings, **limits: int) -> Iterator[TestClient]:
    with TestClient(create_app(settings.model_copy(update={"limits": LIMITS.model_copy(update=limits)}))) as c:
        yield c


@pytest.fixture(scope="module")
def roomy(settings: Settings) -> Iterator[TestClient]:
    """The conftest models with a dense-work budget large enough for every analysis of the tiny models."""
    yield from _limited_client(settings, matrix_budget_bytes=16 * 2**20)


@pytest.fixture(scope="module")
def tight(settings: Settings) -> Iterator[TestClient]:
    yield from _limited_client(settings, matrix_budget_bytes=1024, peak_bytes=1024)  # every priced request is over it
