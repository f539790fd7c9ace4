"""The rotary-model API over a real app: positional kernel, band energies, composition profiles,
QK and composition at an offset; numbers checked against the engine's dense float64 brute force."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from markupsafe import escape as html_escape

from app.main import create_app
from app.scheduling import bind
from app.settings import Settings
from app.views.rotary import POSITIONAL, PositionalParams, QKCopyingParams, qk_copying_cost
from app.views.shared.rotary_reference import reference_tokens
from circuits_core.circuits import rotary
from circuits_core.circuits.rotary import REFERENCE_NAME, rotation
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.model.config import ModelConfig
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer
from tests.core.rotary_models import rotary_config

API = "/api/v1/models"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rotary-models")
    tok = train_tokenizer()
    V = tok.get_vocab_size()
    rope = rotary_config(n_layers=3, d_vocab=V, n_ctx=96, n_key_value_heads=2, rotary_adjacent_pairs=True, rotary_dim=6)
    save_qkov(root / "shipped" / "rope", rope, tok, seed=3)
    short = ModelConfig(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=32)
    save_qkov(root / "user" / "short", short, tok, seed=4)
    return root / "shipped", root / "user"


@pytest.fixture(scope="module")
def client(folders: tuple[Path, Path]) -> Iterator[TestClient]:
    settings = Settings(shipped_dir=folders[0], models_dir=folders[1], dtype="float64", limits=LIMITS, store_url="off")
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def rope(folders: tuple[Path, Path]) -> LoadedModel:
    return load_checkpoint(folders[0] / "rope", dtype=torch.float64)


def normed(model, x, layer):
    """RMS norm by hand (the gain is folded into W_Q, W_K when the checkpoint is processed: RMSPre)."""
    w = getattr(model.blocks[layer].ln1, "w", None)
    x = x / (x.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
    return x * w if w is not None else x


def test_positional_kernel_vs_dense(client: TestClient, rope: LoadedModel):
    body = client.get(f"{API}/rope/heads/L2H3/positional", params={"max_offset": 20}).json()
    assert body["offsets"] == list(range(21))
    assert body["reference"]["name"] == REFERENCE_NAME and body["reference"]["tokenized"]
    model = rope.model
    tokens, ref = reference_tokens(rope)
    assert body["reference"]["n_tokens"] == ref.n_tokens == tokens.shape[1]
    _, cache = model.run(tokens, names={"blocks.2.hook_resid_pre"})
    mu = normed(model, cache["blocks.2.hook_resid_pre"][0, 1:], 2).mean(0)  # [d]
    attn = model.blocks[2].attn
    q, k = mu @ attn.W_Q[3], mu @ attn._W_K[3 // 2]  # GQA: query head 3 reads key head 1
    expected = [float(q @ rotation(model, [d])[0] @ k) / model.cfg.scale for d in range(21)]
    assert max(abs(a - b) for a, b in zip(body["kernel"], expected, strict=True)) < 1e-10
    assert body["peak_offset"] == max(range(21), key=lambda d: expected[d])


def test_bands_sum_identity(client: TestClient, rope: LoadedModel):
    body = client.get(f"{API}/rope/heads/L1H2/bands").json()
    attn = rope.model.blocks[1].attn
    W_Q, W_K = attn.W_Q[2], attn._W_K[1]
    for k, (e, c, s) in enumerate(zip(body["energy"], body["cos_part"], body["sin_part"], strict=True)):
        pair = [2 * k, 2 * k + 1]  # adjacent layout
        assert abs(e - float(W_Q[:, pair].pow(2).sum() * W_K[:, pair].pow(2).sum())) < 1e-10 * e
        assert abs(e - c - s) < 1e-12 * e
    unrot = W_Q[:, 6:] @ W_K[:, 6:].T  # rotary_dim 6 of d_head 8
    assert abs(body["unrotated"] - float(unrot.pow(2).sum())) < 1e-10


def test_composition_profile_vs_dense(client: TestClient, rope: LoadedModel):
    body = client.get(f"{API}/rope/composition/L0H1/L2H2/profile", params={"kind": "K", "max_offset": 10}).json()
    a, b = rope.model.blocks[0].attn, rope.model.blocks[2].attn
    W_OV = a._W_V[0] @ a.W_O[1]
    for d, score in zip(body["offsets"], body["scores"], strict=True):
        Om = b.W_Q[2] @ rotation(rope.model, [d])[0] @ b._W_K[1].T
        assert abs(score - float((W_OV @ Om.T).norm() / (W_OV.norm() * Om.norm()))) < 1e-12
    assert body["peak"] == max(body["scores"]) and body["scores"][body["peak_offset"]] == body["peak"]
    assert 0 < body["baseline"] < 1


def test_refusals(client: TestClient):
    assert_problem(client.get(f"{API}/short/heads/L1H0/positional"), 422, "rotary")
    assert_problem(client.get(f"{API}/short/composition/L0H0/L1H1/profile"), 422, "rotary")
    clipped = client.get(f"{API}/rope/heads/L0H0/positional", params={"max_offset": 500}).json()
    assert clipped["offsets"] == list(range(96))  # n_ctx 96: no query is further than 95 from its key
    assert_problem(client.get(f"{API}/rope/composition/L2H0/L1H1/profile"), 422, "earlier")
    assert client.get(f"{API}/rope/composition/L0H0/L1H1/profile", params={"kind": "V"}).status_code == 422
    assert client.get(f"{API}/rope/heads/L9H0/bands").status_code == 404


def test_openapi_documents_the_rotary_routes(client: TestClient):
    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/api/v1/models/{model}/heads/{head}/positional",
        "/api/v1/models/{model}/heads/{head}/bands",
        "/api/v1/models/{model}/composition/{source}/{target}/profile",
    ):
        assert path in paths
    params = {p["name"]: p for p in paths["/api/v1/models/{model}/heads/{head}/positional"]["get"]["parameters"]}
    assert params["max_offset"]["schema"]["maximum"] == 4096


def dense_qk(loaded: LoadedModel, layer: int, h: int, delta: int) -> torch.Tensor:
    """[V, V] W_E_eff W_Q R(δ) W_K^T W_E_eff^T / s with the layer-0 RMS norm written by hand."""
    model = loaded.model
    E = normed(model, model.W_E, 0)
    attn = model.blocks[layer].attn
    return E @ attn.W_Q[h] @ rotation(model, [delta])[0] @ attn._W_K[h // 2].T @ E.T / model.cfg.scale


@pytest.mark.parametrize("delta", [0, 3])
def test_qk_at_offset_vs_dense(client: TestClient, rope: LoadedModel, delta: int):
    dense = dense_qk(rope, 1, 3, delta)
    top = client.get(f"{API}/rope/heads/L1H3/qk", params={"offset": delta, "k": 5}).json()
    assert top["offset"] == delta
    values = dense.flatten().topk(5).values.tolist()
    assert max(abs(e["value"] - v) for e, v in zip(top["entries"], values, strict=True)) < 1e-10
    row = client.get(f"{API}/rope/heads/L1H3/qk", params={"offset": delta, "k": 4, "token": "7"}).json()
    assert [e["col"]["id"] for e in row["entries"]] == dense[7].topk(4).indices.tolist()
    col = client.get(f"{API}/rope/heads/L1H3/qk", params={"offset": delta, "k": 4, "token": "7", "side": "key"}).json()
    assert [e["row"]["id"] for e in col["entries"]] == dense[:, 7].topk(4).indices.tolist()


def sorted_spectrum(z: torch.Tensor) -> torch.Tensor:
    return z[sorted(range(z.numel()), key=lambda i: (round(float(z[i].real), 7), round(float(z[i].imag), 7)))]


def test_qk_copying_at_offset_vs_real_attention_scores(client: TestClient, rope: LoadedModel):
    """Layer 0: the V x V full QK circuit at δ = 3 read off real hook_attn_scores (query token b at position 3, key
    token a at position 0, for every (a, b)), its dense float64 spectrum vs the API's d_head eigenvalues and score."""
    model, V, dh, delta = rope.model, rope.model.cfg.d_vocab, rope.model.cfg.d_head, 3
    a, b = torch.cartesian_prod(torch.arange(V), torch.arange(V)).T  # [V^2] each
    tokens = torch.stack([a, torch.zeros_like(a), torch.zeros_like(a), b], dim=1)  # [V^2, 4]: key at 0, query at 3
    scores = []
    for chunk in tokens.split(8192):
        _, cache = model.run(chunk, names={"blocks.0.attn.hook_attn_scores"})
        scores.append(cache["blocks.0.attn.hook_attn_scores"][:, 3, delta, 0])  # head L0H3
    dense = torch.cat(scores).view(V, V).T  # [query b, key a]
    eig = torch.linalg.eigvals(dense)
    top = eig[eig.abs().argsort(descending=True)[:dh]]
    body = client.get(f"{API}/rope/heads/L0H3/qk-copying", params={"offset": delta, "max_offset": 5}).json()
    got = torch.tensor([complex(z["re"], z["im"]) for z in body["eigenvalues"]], dtype=torch.complex128)
    assert body["offset"] == delta and body["offsets"] == list(range(6))
    assert torch.allclose(sorted_spectrum(got), sorted_spectrum(top), atol=1e-9)
    assert abs(body["score"] - float(eig.sum().real / eig.abs().sum())) < 1e-9
    assert body["scores"][delta] == body["score"]


def test_qk_copying_curve_vs_dense(client: TestClient, rope: LoadedModel):
    body = client.get(f"{API}/rope/heads/L2H1/qk-copying", params={"max_offset": 12}).json()
    expected = []
    for d in range(13):
        eig = torch.linalg.eigvals(dense_qk(rope, 2, 1, d))
        expected.append(float(eig.sum().real / eig.abs().sum()))
    assert max(abs(x - y) for x, y in zip(body["scores"], expected, strict=True)) < 1e-9
    assert body["peak_offset"] == max(range(13), key=lambda d: expected[d]) and body["offset"] == 0
    for params in ({"max_offset": 1}, {"max_offset": 4096, "offset": 95}):  # the priced answer bounds the real one
        answer = client.get(f"{API}/rope/heads/L2H1/qk-copying", params=params)
        assert len(answer.content) <= qk_copying_cost(rope, QKCopyingParams(head="L2H1", **params), LIMITS).answer_bytes
    assert_problem(client.get(f"{API}/short/heads/L1H0/qk-copying"), 422, "rotary")
    assert_problem(client.get(f"{API}/rope/heads/L1H0/qk-copying", params={"offset": 96}), 422, "n_ctx")
    assert client.get(f"{API}/rope/heads/L1H0/qk-copying", params={"offset": -1}).status_code == 422
    assert client.get(f"{API}/rope/heads/L7H0/qk-copying").status_code == 404
    params = {
        p["name"]
        for p in client.get("/openapi.json").json()["paths"]["/api/v1/models/{model}/heads/{head}/qk-copying"]["get"][
            "parameters"
        ]
    }
    assert {"offset", "max_offset"} <= params


def test_composition_at_offset_matches_the_profile(client: TestClient):
    matrix = client.get(f"{API}/rope/composition", params={"kind": "Q", "offset": 5}).json()
    assert matrix["offset"] == 5
    profile = client.get(f"{API}/rope/composition/L0H3/L2H1/profile", params={"kind": "Q", "max_offset": 8}).json()
    score = matrix["scores"][matrix["sources"].index("L0H3")][matrix["targets"].index("L2H1")]
    assert abs(score - profile["scores"][5]) < 1e-10
    zero = client.get(f"{API}/rope/composition", params={"kind": "Q"}).json()
    assert zero["offset"] == 0
    assert (
        abs(zero["scores"][matrix["sources"].index("L0H3")][matrix["targets"].index("L2H1")] - profile["scores"][0])
        < 1e-10
    )


def test_offset_refusals(client: TestClient):
    assert_problem(client.get(f"{API}/short/heads/L1H0/qk", params={"offset": 1}), 422, "rotary")
    assert_problem(client.get(f"{API}/short/composition", params={"kind": "K", "offset": 2}), 422, "rotary")
    assert_problem(client.get(f"{API}/rope/composition", params={"kind": "V", "offset": 2}), 422, "offset")
    assert_problem(client.get(f"{API}/rope/heads/L1H0/qk", params={"offset": 96}), 422, "n_ctx")
    assert client.get(f"{API}/short/heads/L1H0/qk").json()["offset"] is None


def test_heads_table_kernel_peaks(client: TestClient, rope: LoadedModel):
    """Each head's kernel_peak_offset is the argmax of its positional kernel over δ = 0..64 (API answer)."""
    table = client.get(f"{API}/rope/heads").json()
    heads = {s["head"]: s for s in table["heads"]}
    for name in ("L0H0", "L1H2", "L2H3"):
        kernel = client.get(f"{API}/rope/heads/{name}/positional", params={"max_offset": 64}).json()
        values, offsets = kernel["kernel"], kernel["offsets"]
        assert offsets == list(range(65))
        best = max(range(len(values)), key=lambda i: values[i])  # the peak read off the kernel's own values
        assert heads[name]["kernel_peak_offset"] == offsets[best] == kernel["peak_offset"]
    # the text μ came from: the reference text tokenized by the model's own tokenizer, cut at n_ctx
    ids = rope.tokenizer.encode(rotary.REFERENCE_TEXT)[: rope.model.cfg.n_ctx]
    assert table["kernel_reference"] == {"name": rotary.REFERENCE_NAME, "n_tokens": len(ids), "tokenized": True}
    short = client.get(f"{API}/short/heads").json()
    assert all(s["kernel_peak_offset"] is None for s in short["heads"]) and short["kernel_reference"] is None
    html = client.get("/models/rope").text
    assert "kernel peak δ" in html and "kernel peak δ" not in client.get("/models/short").text
    assert str(html_escape(table["kernel_reference"]["name"])) in html  # named under the table (as Jinja escapes it)


def test_skip_trigrams_at_offset_vs_dense(client: TestClient, rope: LoadedModel):
    dense = dense_qk(rope, 2, 1, 6)  # [V, V] at δ = 6
    body = client.get(f"{API}/rope/heads/L2H1/skip-trigrams", params={"token": "11", "k": 5, "offset": 6}).json()
    assert body["offset"] == 6
    assert [d["token"]["id"] for d in body["destinations"]] == dense[:, 11].topk(5).indices.tolist()
    assert client.get(f"{API}/short/heads/L1H0/skip-trigrams", params={"offset": 1}).status_code == 422


def test_rotary_views_take_the_raw_basis(folders: tuple[Path, Path], tmp_path: Path) -> None:
    """basis=raw on the positional kernel, the band energies, QK copying over δ and a composition profile equals
    the same checkpoint served unprocessed by its folder (qkov.json {"processing": false}: another loading route),
    and differs from the processed answer (RMS gains folded into W_Q, W_K)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shipped = tmp_path / "shipped"
    shutil.copytree(folders[0] / "rope", shipped / "rope")
    weights = load_file(str(shipped / "rope" / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in weights if n.endswith(("ln1.w", "ln2.w", "ln_final.w"))]:  # gains that processing folds
        weights[name] = weights[name] * (
            0.5 + torch.rand(weights[name].shape, generator=gen, dtype=weights[name].dtype)
        )
    save_file(weights, str(shipped / "rope" / "model.safetensors"))
    shutil.copytree(shipped / "rope", shipped / "stored")
    (shipped / "stored" / "qkov.json").write_text(json.dumps({"processing": False}))
    settings = Settings(shipped_dir=shipped, models_dir=None, dtype="float64", limits=LIMITS, store_url="off")
    with TestClient(create_app(settings)) as c:
        for path in (
            "heads/L1H2/positional",
            "heads/L1H2/bands",
            "heads/L1H2/qk-copying?offset=3",
            "composition/L0H1/L2H3/profile?kind=K",
        ):
            sep = "&" if "?" in path else "?"
            raw = c.get(f"/api/v1/models/rope/{path}{sep}basis=raw").json()
            stored = c.get(f"/api/v1/models/stored/{path}").json()
            served = c.get(f"/api/v1/models/rope/{path}").json()
            for key in ("kernel", "energy", "scores"):
                if key in raw:
                    assert raw[key] == pytest.approx(stored[key], abs=1e-12), (path, key)
                    moved = max(abs(a - b) for a, b in zip(raw[key], served[key], strict=True))
                    if key == "kernel":  # μ Ω(δ) μᵀ: the gain moves from μ (raw) into W_Q, W_K (folded): invariant
                        assert moved < 1e-12, (path, moved)
                    else:
                        assert moved > 1e-6, (path, moved)
            assert "raw weights" in raw["basis"] and "raw weights" not in served["basis"], path
        page = c.get("/models/rope/heads/L1H2", params={"basis": "raw"}).text
        assert page.count("raw weights, as stored") >= 3  # the circuits panel and the rotary panels follow the picker


def test_the_kernel_prices_the_reference_forward_pass_until_it_is_kept(folders: tuple[Path, Path]) -> None:
    """The positional kernel's FLOP price holds the forward pass over the reference text's own tokens (its tokenised
    length, not a bound), and once μ is in the result cache only the kernel itself: the price is the engine's
    rotary.kernel_cost on those token counts, and the served model's reference is what the view measures (a fresh
    app: nothing cached)."""
    settings = Settings(shipped_dir=folders[0], models_dir=folders[1], dtype="float64", limits=LIMITS, store_url="off")
    with TestClient(create_app(settings)) as client:
        _kernel_price_until_kept(client)


def _kernel_price_until_kept(client: TestClient) -> None:
    app = client.app
    loaded = app.state.registry.get("rope")  # type: ignore[attr-defined]
    limits = app.state.settings.limits  # type: ignore[attr-defined]
    params = PositionalParams(head="L2H3", max_offset=20)
    n = reference_tokens(loaded)[1].n_tokens
    assert n < len(rotary.REFERENCE_TEXT)  # tokens, not characters

    def priced() -> int:  # in a context of its own, bound to this app's cache (as a request is)
        bind(app.state.compute, None)  # type: ignore[attr-defined]
        return POSITIONAL.cost(loaded, params, limits).flops

    before = contextvars.copy_context().run(priced)
    assert before == rotary.kernel_cost(loaded.model, 21, n).flops
    body = client.get(f"{API}/rope/heads/L2H3/positional", params={"max_offset": 20}).json()
    assert body["reference"]["n_tokens"] == n
    after = contextvars.copy_context().run(priced)
    assert after == rotary.kernel_cost(loaded.model, 21, 0).flops < before
