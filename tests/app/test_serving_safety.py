"""Safety of a public demo: model ids name only folders of the models directory (no traversal, no symlink
escape, no odd bytes), a malicious pickle in a models-dir folder is refused without running, token text with
markup is escaped on pages and served as JSON data by the API, and a new folder shows up without a restart.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.config import ModelConfig
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer

XSS = "<script>alert(1)</script>"


class Payload:
    """Unpickling this writes a file: the proof that a pickle ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.write_text, (self.marker, "the payload ran"))


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory, model_dirs: tuple[Path, Path]) -> tuple[Path, Path, Path]:
    """models/ (xss, evil, a symlink escape), outside/ (a valid model reachable only through the symlink)."""
    base = tmp_path_factory.mktemp("serving-safety")
    shipped, models, outside = base / "shipped", base / "models", base / "outside"
    shutil.copytree(model_dirs[0] / "tiny-2l", shipped / "tiny-2l")
    tok = train_tokenizer()
    tok.add_tokens([XSS])
    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=tok.get_vocab_size(), n_ctx=32,
                      positional_embedding_type="standard")
    save_qkov(models / "xss", cfg, tok, seed=5)
    save_qkov(outside / "secret", cfg, tok, seed=6)
    (models / "escape").symlink_to(outside / "secret", target_is_directory=True)
    evil = models / "evil"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps(cfg.to_dict()))
    torch.save({"embed.W_E": Payload(base / "pwned.txt")}, evil / "model.pth")
    return shipped, models, base


@pytest.fixture(scope="module")
def safe_client(roots: tuple[Path, Path, Path]) -> Iterator[TestClient]:
    shipped, models, _ = roots
    with TestClient(create_app(Settings(shipped_dir=shipped, models_dir=models, dtype="float64", limits=LIMITS))) as c:
        yield c


@pytest.mark.parametrize(
    "model_id",
    ["..", "%2e%2e", "..%2F..%2Fetc", "%2Fetc%2Fpasswd", "%2F", "escape", "secret", "a%00b", "caf%C3%A9",
     "tiny-2l%0A", "tiny-2l%20", ".hidden", "~root", "tiny-2l;ls", "%5C..%5Cx"],
)
def test_model_ids_never_reach_outside_the_models_directory(safe_client: TestClient, model_id: str) -> None:
    api = safe_client.get(f"/api/v1/models/{model_id}/heads")
    assert api.status_code == 404, (model_id, api.status_code, api.text)
    assert api.headers["content-type"].startswith("application/problem+json")
    page = safe_client.get(f"/models/{model_id}")
    if page.request.url.raw_path.decode().startswith("/models/"):  # httpx itself resolves a bare '..' to '/'
        assert page.status_code == 404, (model_id, page.status_code)


def test_symlinked_folder_is_not_listed(safe_client: TestClient) -> None:
    ids = {m["id"] for m in safe_client.get("/api/v1/models").json()}
    ids |= {m["id"] for m in safe_client.get("/api/v1/unavailable-models").json()}
    assert "escape" not in ids and "secret" not in ids
    assert {"tiny-2l", "xss"} <= ids


def test_malicious_pickle_is_refused_and_never_runs(safe_client: TestClient, roots: tuple[Path, Path, Path]) -> None:
    marker = roots[2] / "pwned.txt"
    assert_problem(safe_client.get("/api/v1/models/evil"), 422, "evil")
    assert_problem(safe_client.get("/api/v1/models/evil/heads"), 422)
    page = safe_client.get("/models/evil")
    assert page.status_code == 422 and page.headers["content-type"].startswith("text/html")
    assert "evil" in {m["id"] for m in safe_client.get("/api/v1/unavailable-models").json()}
    assert not marker.exists()
    assert safe_client.get("/api/v1/models/tiny-2l").status_code == 200  # the server is fine


def test_token_markup_is_data_in_json_and_escaped_on_pages(safe_client: TestClient) -> None:
    api = safe_client.get("/api/v1/models/xss/tokenize", params={"prompt": f"the {XSS} cat"})
    assert api.status_code == 200 and api.headers["content-type"].startswith("application/json")
    assert XSS in [t["text"] for t in api.json()["tokens"]]  # the token itself, as JSON data
    page = safe_client.get("/models/xss/detectors", params={"prompt": f"the {XSS} cat"})
    assert page.status_code == 200, page.text
    assert "&lt;script&gt;" in page.text or "\\u003cscript" in page.text
    assert XSS not in page.text and "<script>alert" not in page.text
    for path, status in ((f"/models/{XSS}", 404), (f"/models/xss/heads/{XSS}", 404), (f"/models/xss/direct?token={XSS}", 200)):
        answer = safe_client.get(path)  # unknown model, no such URL, the token as a query (its page)
        assert answer.status_code == status and "<script>alert" not in answer.text, path
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in answer.text


def test_a_new_folder_is_served_without_a_restart(safe_client: TestClient, roots: tuple[Path, Path, Path],
                                                  model_dirs: tuple[Path, Path]) -> None:
    models = roots[1]
    assert safe_client.get("/api/v1/models/fresh").status_code == 404
    shutil.copytree(model_dirs[1] / "tiny-ln", models / "fresh")
    try:
        assert safe_client.get("/api/v1/models/fresh").status_code == 200
        assert "fresh" in {m["id"] for m in safe_client.get("/api/v1/models").json()}
    finally:
        shutil.rmtree(models / "fresh")
