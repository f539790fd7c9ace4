"""The model folders of the hostile pass over the token-set, sampling, offset and basis parameters
(test_hostile_vocab_basis_params.py, test_hostile_prices_schema_pages.py, test_hostile_precompute_and_http.py): edge
models (LayerNorm, rotary, tiny contexts, a wide vocabulary, no layers, zero weights, broken token counts), the
settings they are served with, DEFAULT_VOCAB lowered so that the wide model counts as a large vocabulary, and the
check that an answer is never a server error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

import app.routers.pages as pages
import app.routers.pages_heads as pages_heads
import app.views.shared.token_sets as token_sets
from app.main import create_app
from app.settings import Settings
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from circuits_core.prompt.phenomena import TOKEN_COUNTS_FILE
from tests.app.conftest import LIMITS, save_qkov, train_tokenizer

API = "/api/v1/models"


WIDE_V, SMALL_DEFAULT = 700, 256  # the "wide" model is a large vocabulary once DEFAULT_VOCAB is lowered to 256


def build_folders(root: Path) -> tuple[Path, Path]:
    """shipped/two (shortformer, token counts), user/: twin (two's files under another id), ln (standard positions,
    LayerNorm: served processed), rope (rotary, RMS, GQA), ctx2/ctx3 (n_ctx 2 and 3), zero (no layers), wide
    (700 tokens, token counts, processing off); float-counts, short-counts, object-counts (wide with a malformed
    token_counts.npy: floats, 10 entries, a pickled object array)."""
    tok = train_tokenizer()
    V = tok.get_vocab_size()
    shipped, user = root / "shipped", root / "user"
    two = ModelConfig(
        n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=32, positional_embedding_type="shortformer"
    )
    for folder in (shipped / "two", user / "twin"):
        save_qkov(folder, two, tok, seed=1)
        np.save(folder / TOKEN_COUNTS_FILE, np.random.default_rng(0).integers(0, 100, V))
    save_qkov(
        user / "ln",
        ModelConfig(
            n_layers=2,
            d_model=16,
            n_heads=2,
            d_head=8,
            d_vocab=V,
            n_ctx=32,
            positional_embedding_type="standard",
            normalization_type="LN",
        ),
        tok,
        seed=2,
    )
    save_qkov(
        user / "rope",
        ModelConfig(
            n_layers=2,
            d_model=16,
            n_heads=4,
            d_head=8,
            d_vocab=V,
            n_ctx=32,
            normalization_type="RMS",
            positional_embedding_type="rotary",
            n_key_value_heads=2,
        ),
        tok,
        seed=3,
    )
    for n in (2, 3):
        save_qkov(
            user / f"ctx{n}", ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=n), tok, seed=4
        )
    save_qkov(user / "zero", ModelConfig(n_layers=0, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=32), tok, seed=5)
    wide = random_model(
        ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=4, d_vocab=WIDE_V, n_ctx=16),
        seed=6,
        dtype=torch.float64,
        std_embed=0.5,
    )
    save_checkpoint(wide, user / "wide")
    (user / "wide" / "qkov.json").write_text(json.dumps({"processing": False}))
    np.save(user / "wide" / TOKEN_COUNTS_FILE, np.random.default_rng(1).permutation(WIDE_V) * 3 + 1)
    for name, counts in {"float-counts": np.random.default_rng(2).random(WIDE_V), "short-counts": np.arange(10),
                         "object-counts": np.array([{"a": 1}] * WIDE_V, dtype=object)}.items():  # fmt: skip
        save_checkpoint(wide, user / name)
        (user / name / "qkov.json").write_text(json.dumps({"processing": False}))
        np.save(user / name / TOKEN_COUNTS_FILE, counts, allow_pickle=True)
    return shipped, user


def hostile_settings(folders: tuple[Path, Path], **limits: int) -> Settings:
    return Settings(shipped_dir=folders[0], models_dir=folders[1], dtype="float64", store_url="off",
                    limits=LIMITS.model_copy(update=limits), max_model_bytes=10**9)  # fmt: skip


@contextmanager
def small_default_vocab() -> Iterator[None]:
    """DEFAULT_VOCAB lowered to SMALL_DEFAULT, so that the wide model (WIDE_V tokens) has a large vocabulary."""
    patch = pytest.MonkeyPatch()
    patch.setattr(token_sets, "DEFAULT_VOCAB", SMALL_DEFAULT)
    patch.setattr(pages, "DEFAULT_VOCAB", SMALL_DEFAULT)
    patch.setattr(pages_heads, "DEFAULT_VOCAB", SMALL_DEFAULT)  # the head page's (app/routers/pages_heads.py)
    try:
        yield
    finally:
        patch.undo()


def served_app(folders: tuple[Path, Path]) -> Iterator[tuple[Any, TestClient]]:
    """The app on the folders (server exceptions answered as 500s, not raised), with the small default vocabulary."""
    with small_default_vocab():
        app = create_app(hostile_settings(folders))
        with TestClient(app, raise_server_exceptions=False) as c:
            yield app, c


def poor_client(folders: tuple[Path, Path]) -> Iterator[TestClient]:
    """The same models with 1 KiB of working memory per request: every computation is refused by its price."""
    with small_default_vocab():
        settings = hostile_settings(folders, peak_bytes=1024, matrix_budget_bytes=1024)
        with TestClient(create_app(settings), raise_server_exceptions=False) as c:
            yield c


def no_5xx(response: Any) -> None:
    assert response.status_code < 500, (str(response.request.url), response.status_code, response.text[:300])
    if response.status_code >= 400 and response.request.url.path.startswith("/api/"):
        assert response.headers["content-type"].startswith("application/problem+json"), response.text[:300]
        assert response.json()["detail"]
