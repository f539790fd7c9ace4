"""API: model listing and summary, tokenisation, refusals as problem+json, OpenAPI limits, docs page."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.formats.checkpoint import LoadedModel
from tests.app.conftest import CARD, LIMITS, assert_problem, save_qkov, train_tokenizer


def test_models_lists_both_folders_and_reports_broken(client: TestClient, tiny: LoadedModel) -> None:
    models = client.get("/api/v1/models").json()
    assert isinstance(models, list)  # the contract: a bare list of models
    ids = [m["id"] for m in models]
    assert ids == ["tiny-2l", "tiny-ln"]  # .hidden and empty are never models
    two = models[0]
    cfg = tiny.model.cfg
    for field in (
        "n_layers",
        "n_heads",
        "d_model",
        "d_head",
        "d_vocab",
        "n_ctx",
        "attn_only",
        "positional_embedding_type",
        "normalization_type",
    ):
        assert two[field] == getattr(cfg, field), field
    assert two["shipped"] is True and models[1]["shipped"] is False
    assert two["heads"] == cfg.head_names and two["format"] == tiny.format and two["digest"] == str(tiny.digest)
    assert two["has_tokenizer"] and two["bos_token_id"] == tiny.tokenizer.bos_token_id
    assert two["card"] == CARD and two["format"] == "qkov"
    unavailable = {u["id"]: u["detail"] for u in client.get("/api/v1/unavailable-models").json()}
    assert unavailable.keys() == {"broken", "mamba"}
    assert "W_K" in unavailable["broken"] and "mamba" in unavailable["mamba"]


def test_model_summary_and_unknown_models(client: TestClient) -> None:
    one = client.get("/api/v1/models/tiny-ln").json()
    assert one["id"] == "tiny-ln" and one["normalization_type"] in ("LN", "LNPre")
    assert isinstance(one["processing"], dict)
    assert_problem(client.get("/api/v1/models/nope"), 404, "unknown model", "tiny-2l")
    assert_problem(client.get("/api/v1/models/.hidden"), 404, "unknown model")
    assert_problem(client.get("/api/v1/models/..%2F..%2Fetc"), 404)
    assert_problem(client.get("/api/v1/models/empty/heads"), 404, "unknown model")


def test_broken_checkpoint_is_422_naming_the_problem(client: TestClient) -> None:
    body = assert_problem(client.get("/api/v1/models/broken"), 422, "broken", "W_K")
    assert body["title"] == "Model cannot be loaded"
    assert_problem(client.get("/api/v1/models/mamba/heads"), 422, "model_type", "mamba")


def test_new_folder_appears_on_next_listing(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    shipped, _ = model_dirs
    settings = Settings(shipped_dir=shipped, models_dir=tmp_path, limits=LIMITS)
    with TestClient(create_app(settings)) as c:
        assert [m["id"] for m in c.get("/api/v1/models").json()] == ["tiny-2l"]
        from circuits_core.model.config import ModelConfig

        tok = train_tokenizer()
        cfg = ModelConfig(n_layers=0, d_model=8, n_heads=1, d_head=8, d_vocab=tok.get_vocab_size(), n_ctx=8)
        save_qkov(tmp_path / "zero", cfg, tok, seed=5)
        assert [m["id"] for m in c.get("/api/v1/models").json()] == ["tiny-2l", "zero"]
        assert c.get("/api/v1/models/zero/heads").json()["heads"] == []


def test_tokenize_text_and_ids(client: TestClient, tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    body = client.get("/api/v1/models/tiny-2l/tokenize", params={"prompt": "the cat sat"}).json()
    ids = tok.encode("the cat sat")
    assert [t["id"] for t in body["tokens"]] == ids and ids[0] == tok.bos_token_id
    assert [t["text"] for t in body["tokens"]] == [tok.token_str(i) for i in ids]
    assert body["n_tokens"] == len(ids) and body["model"]["id"] == "tiny-2l"
    by_ids = client.get("/api/v1/models/tiny-2l/tokenize", params={"tokens": "0, 5,7"}).json()
    assert [t["id"] for t in by_ids["tokens"]] == [0, 5, 7]


def test_prompt_refusals(client: TestClient) -> None:
    url = "/api/v1/models/tiny-2l/tokenize"
    assert_problem(client.get(url, params={"prompt": ""}), 422, "empty")
    assert_problem(client.get(url), 422, "exactly one")
    assert_problem(client.get(url, params={"prompt": "the " * 60}), 422, "at most 40")
    assert_problem(client.get(url, params={"tokens": "1,x"}), 422, "'x'")
    assert_problem(client.get(url, params={"tokens": "1,99999"}), 422, "99999", "vocabulary")
    assert_problem(client.get(url, params={"prompt": "x" * 5000}), 422, "prompt")  # over max_length


def test_validation_errors_are_problem_json(client: TestClient) -> None:
    body = assert_problem(
        client.get("/api/v1/models/tiny-2l/direct", params={"k": 51}), 422, "k", "less than or equal to 50"
    )
    assert body["errors"][0]["loc"] == ["query", "k"]
    assert_problem(client.get("/api/v1/models/tiny-2l/direct", params={"k": "many"}), 422, "k")
    assert_problem(client.get("/api/v1/no-such-route"), 404, "/api/v1/no-such-route")


def test_openapi_contains_limits(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    params = {
        p["name"]: p["schema"] for p in spec["paths"]["/api/v1/models/{model}/heads/{head}/ov"]["get"]["parameters"]
    }
    assert params["k"]["maximum"] == LIMITS.max_k and params["k"]["minimum"] == 1
    det = {p["name"]: p["schema"] for p in spec["paths"]["/api/v1/models/{model}/detectors"]["get"]["parameters"]}
    seq_len = next(
        s for s in det["seq_len"].get("anyOf", [det["seq_len"]]) if s.get("type") == "integer"
    )  # optional: int | None
    assert det["batch"]["maximum"] == LIMITS.max_batch and seq_len["maximum"] == LIMITS.max_seq_len
    for path, item in spec["paths"].items():
        if not path.startswith("/api/v1/"):
            continue
        assert "200" in item["get"]["responses"] and "$ref" in str(item["get"]["responses"]["200"]), path


def test_docs_page_is_self_contained(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/api/v1/models/{model}/heads/{head}/qk" in page.text and "maximum=50" in page.text
    assert "cdn" not in page.text.lower()
    assert re.findall(r'<script src="([^"]+)"', page.text) and all(
        s.startswith("/static/") for s in re.findall(r'<script src="([^"]+)"', page.text)
    )
    assert 'class="topbar"' in page.text and 'id="model-picker"' in page.text  # the dashboard's frame and navigation
    assert client.get("/redoc").status_code == 404


def test_html_error_forms(client: TestClient) -> None:
    fragment = client.get("/no-such-page", headers={"HX-Request": "true"})
    assert fragment.status_code == 404 and fragment.headers["content-type"].startswith("text/html")
    assert "<html" not in fragment.text.lower() and "/no-such-page" in fragment.text
    page = client.get("/no-such-page")
    assert page.status_code == 404 and "<html" in page.text.lower()


def test_unexpected_error_is_logged_500_problem(settings: Settings) -> None:
    app = create_app(settings)

    async def boom() -> None:
        raise RuntimeError("secret internals")

    app.add_api_route("/api/v1/boom", boom)
    with TestClient(app, raise_server_exceptions=False) as c:
        body = assert_problem(c.get("/api/v1/boom"), 500, "unexpected")
    assert "secret" not in body["detail"]


def test_registry_loads_each_model_once_under_concurrency(settings: Settings, monkeypatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import app.registry as registry_module

    calls: list[str] = []
    real = registry_module.load_checkpoint

    def counting(path, **kwargs):
        calls.append(str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(registry_module, "load_checkpoint", counting)
    registry = registry_module.ModelRegistry(settings)
    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(lambda _: registry.get("tiny-2l"), range(8)))
    assert len(calls) == 1 and all(m is loaded[0] for m in loaded)
