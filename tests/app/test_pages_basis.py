"""The basis picker on the head, direct, composition and pair pages: each page names the weights its
numbers come from, and `basis=raw` shows the checkpoint as stored. Checked against dense float64 products of the
weights read straight from the safetensors file (no qkov loading or processing involved), and against the
processed weights the app serves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from app.main import create_app
from app.settings import Settings
from circuits_core.model.config import ModelConfig
from tests.app.conftest import LIMITS, save_qkov, train_tokenizer

M = "ln-2l"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer LayerNorm model with learned positions: served processed (folded LN, centred writers and W_U)."""
    root = tmp_path_factory.mktemp("basis-models")
    tok = train_tokenizer()
    cfg = ModelConfig(
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_head=4,
        d_vocab=tok.get_vocab_size(),
        n_ctx=32,
        positional_embedding_type="standard",
        normalization_type="LN",
    )
    save_qkov(root / M, cfg, tok, seed=7)
    return root


@pytest.fixture(scope="module")
def client(folder: Path) -> TestClient:
    with TestClient(create_app(Settings(shipped_dir=folder, dtype="float64", limits=LIMITS))) as c:
        yield c  # type: ignore[misc]


@pytest.fixture(scope="module")
def stored(folder: Path) -> dict[str, torch.Tensor]:
    """The weights as stored, in float64, read with safetensors alone."""
    return {k: v.double() for k, v in load_file(str(folder / M / "model.safetensors")).items()}


def table_values(html: str, table_id: str) -> list[float]:
    body = html.split(f'id="{table_id}"')[1].split("<tbody>")[1].split("</tbody>")[0]
    return [float(v) for v in re.findall(r'class="num[^"]*" data-value="([^"]+)"', body)]


def layer_norm(X: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    X = X - X.mean(-1, keepdim=True)
    return X / (X.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w + b


def top_values(M_: torch.Tensor, k: int) -> list[float]:
    return M_.flatten().topk(k).values.tolist()


def test_head_page_raw_basis_shows_the_stored_weights(client: TestClient, stored: dict[str, torch.Tensor]) -> None:
    k = 5
    raw_html = client.get(f"/models/{M}/heads/L1H1", params={"k": k, "basis": "raw"}).text
    served_html = client.get(f"/models/{M}/heads/L1H1", params={"k": k}).text
    W_E, W_U = stored["embed.W_E"], stored["unembed.W_U"]
    W_V, W_O = stored["blocks.1.attn.W_V"][1], stored["blocks.1.attn.W_O"][1]
    # the stored weights, nothing folded or centred; rows of W_E through layer 0's ln1 (the paper's W_E_eff)
    expected_raw = top_values(layer_norm(W_E, stored["blocks.0.ln1.w"], stored["blocks.0.ln1.b"]) @ W_V @ W_O @ W_U, k)
    assert table_values(raw_html, "ov-table") == pytest.approx(expected_raw, rel=1e-9, abs=1e-12)
    assert table_values(served_html, "ov-table") != pytest.approx(expected_raw, rel=1e-6)
    assert '<option value="raw" selected>' in raw_html and '<option value="served" selected>' in served_html
    assert "Basis: raw weights, as stored." in raw_html and "Basis: processed weights: LayerNorm folded" in served_html
    assert re.search(
        r'href="/models/ln-2l/heads/L1H1\?token=\d+&amp;k=5&amp;basis=raw"', raw_html
    )  # token links keep it
    assert "/ov?k=5&amp;basis=raw" in raw_html  # and the tables' JSON links
    # the lede's scores and the spectra stay on the served weights, and say so
    assert re.search(r'id="scores-basis">\(scores and spectra: processed weights: LayerNorm folded', raw_html)


def test_direct_page_raw_basis(client: TestClient, stored: dict[str, torch.Tensor]) -> None:
    k = 6
    raw_html = client.get(f"/models/{M}/direct", params={"k": k, "basis": "raw"}).text
    W_E = layer_norm(stored["embed.W_E"], stored["ln_final.w"], stored["ln_final.b"])  # the zero-layer input to W_U
    expected = top_values(W_E @ stored["unembed.W_U"], k)
    assert table_values(raw_html, "direct-table")[0::2] == pytest.approx(expected, rel=1e-9)  # logit, P(next) per row
    served_html = client.get(f"/models/{M}/direct", params={"k": k}).text
    assert "unembedding centred" in served_html and '<select name="basis"' in served_html
    assert table_values(served_html, "direct-table")[0::2] != pytest.approx(expected, rel=1e-6)


def k_composition(stored: dict[str, torch.Tensor], h1: int, h2: int) -> float:
    """‖W_OV¹ W_QK²ᵀ‖_F / (‖W_OV¹‖_F ‖W_QK²‖_F) (row convention) from the stored weights."""
    W_OV = stored["blocks.0.attn.W_V"][h1] @ stored["blocks.0.attn.W_O"][h1]
    W_QK = stored["blocks.1.attn.W_Q"][h2] @ stored["blocks.1.attn.W_K"][h2].T
    return float(torch.linalg.norm(W_OV @ W_QK.T) / (torch.linalg.norm(W_OV) * torch.linalg.norm(W_QK)))


def test_composition_pages_name_and_switch_their_basis(client: TestClient, stored: dict[str, torch.Tensor]) -> None:
    raw = client.get(f"/api/v1/models/{M}/composition", params={"kind": "K", "basis": "raw"}).json()
    served = client.get(f"/api/v1/models/{M}/composition", params={"kind": "K"}).json()
    assert raw["basis"] == "raw weights, as stored" and served["basis"].startswith("processed weights")
    for i, src in enumerate(raw["sources"]):
        for j, dst in enumerate(raw["targets"]):
            if src.startswith("L0") and dst.startswith("L1"):
                assert raw["scores"][i][j] == pytest.approx(k_composition(stored, int(src[-1]), int(dst[-1])), rel=1e-9)
    assert raw["scores"] != served["scores"]  # centring the writers and folding LN change the scores
    html = client.get(f"/models/{M}/composition", params={"kind": "K", "basis": "raw"}).text
    assert "Basis: raw weights, as stored." in html and '<option value="raw" selected>' in html
    assert "kind=Q&amp;basis=raw" in html and "/composition/L0H0/L1H0?basis=raw" in html
    top = raw["top_pairs"][0]
    assert table_values(html, "pairs-table")[0] == pytest.approx(top["score"])
    pair = client.get(f"/models/{M}/composition/{top['source']}/{top['target']}", params={"basis": "raw"}).text
    assert "Basis: raw weights, as stored." in pair and '<option value="raw" selected>' in pair
    assert f"K-composition {top['score']:.4f}" in pair


def test_no_picker_where_the_stored_weights_are_served(client: TestClient, folder: Path, tmp_path: Path) -> None:
    """A shortformer model without LayerNorm is served unchanged: the basis line says so and there is no picker."""
    tok = train_tokenizer()
    cfg = ModelConfig(
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_head=4,
        d_vocab=tok.get_vocab_size(),
        n_ctx=32,
        positional_embedding_type="shortformer",
    )
    save_qkov(tmp_path / "plain", cfg, tok, seed=8)
    with TestClient(create_app(Settings(shipped_dir=tmp_path, dtype="float64", limits=LIMITS))) as c:
        for page in ("/models/plain/heads/L1H0", "/models/plain/direct", "/models/plain/composition"):
            html = c.get(page).text
            assert "the stored weights are the only basis" in html and 'name="basis"' not in html, page


def test_an_rms_model_names_its_norm(tmp_path: Path) -> None:
    """RMSNorm weights are folded too; the basis line names the norm the model has."""
    tok = train_tokenizer()
    cfg = ModelConfig(
        n_layers=1,
        d_model=16,
        n_heads=2,
        d_head=4,
        d_vocab=tok.get_vocab_size(),
        n_ctx=32,
        positional_embedding_type="standard",
        normalization_type="RMS",
    )
    save_qkov(tmp_path / "rms", cfg, tok, seed=9)
    with TestClient(create_app(Settings(shipped_dir=tmp_path, dtype="float64", limits=LIMITS))) as c:
        html = c.get("/models/rms/heads/L0H0").text
    assert "RMSNorm folded into the reading weights" in html and "LayerNorm folded" not in html


def test_overview_names_the_basis_of_its_copying_scores(client: TestClient) -> None:
    html = client.get(f"/models/{M}").text
    assert re.search(r'id="heads-basis">processed weights: LayerNorm folded into the reading weights', html)


def test_the_residual_stream_pages_take_the_raw_basis(client: TestClient, stored: dict[str, torch.Tensor]) -> None:
    """Virtual weights on the stored weights: the pair L0H1 -> L1H0.V with basis=raw is ‖W_OV⁰ W_OV¹‖ / (‖W_OV⁰‖
    ‖W_OV¹‖) of the safetensors weights (no folded LayerNorm, no centring), the all-pairs table holds the same cell,
    usage answers on them too, and each page offers the picker (this model is served processed)."""
    W_OV = [
        stored[f"blocks.{layer}.attn.W_V"][h] @ stored[f"blocks.{layer}.attn.W_O"][h] for layer, h in ((0, 1), (1, 0))
    ]
    expected = float(torch.linalg.norm(W_OV[0] @ W_OV[1]) / (torch.linalg.norm(W_OV[0]) * torch.linalg.norm(W_OV[1])))
    raw = client.get(f"/api/v1/models/{M}/residual/L0H1/L1H0.V", params={"basis": "raw"}).json()
    served = client.get(f"/api/v1/models/{M}/residual/L0H1/L1H0.V").json()
    assert raw["score"] == pytest.approx(expected, abs=1e-12) and raw["basis"] != served["basis"]
    assert "raw" in raw["basis"] and abs(served["score"] - expected) > 1e-6  # the folded LayerNorm changes it
    table = client.get(f"/api/v1/models/{M}/residual", params={"basis": "raw"}).json()
    cell = table["scores"][table["writers"].index("L0H1")][table["readers"].index("L1H0.V")]
    assert cell == pytest.approx(expected, abs=1e-12)
    assert client.get(f"/api/v1/models/{M}/residual/usage", params={"basis": "raw"}).json()["basis"] == raw["basis"]
    for path in ("residual", "residual/usage", "residual/L0H1/L1H0.V"):
        page = client.get(f"/models/{M}/{path}", params={"basis": "raw"}).text
        assert 'id="basis-select"' in page and '<option value="raw" selected>' in page, path
        assert raw["basis"] in page, path
