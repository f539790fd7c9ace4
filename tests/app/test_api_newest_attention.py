"""Every model analysis of the catalogue answers on models with the newest attention: a Gemma 3-shaped model (per-head
QK-norm, multi-query, local layers with their own rope base and a window shorter than the prompt, sandwich norms) and a
Gemma 2-shaped one (soft caps on scores and logits, alternate windows), plus an OLMo 2-shaped one (QK-norm over the
layer, output norms only). Each request (default parameters, a prompt where one is needed) must answer 200; QK tables
say which form their numbers are in, and a capped model's QK table holds capped values (checked against the engine's
factors)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.catalog import ANALYSES
from app.main import create_app
from app.settings import Settings
from circuits_core.circuits.composition_rotary import pair_profile
from circuits_core.circuits.rotary import full_qk_circuit_at, full_qk_row_at
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model.config import ModelConfig
from tests.app.conftest import LIMITS, save_qkov, train_tokenizer

API = "/api/v1/models"
PROMPT = "def add(self, name, value): return value + name"
SHAPES = {
    "gemma3ish": dict(
        n_key_value_heads=1, qk_norm="head", window_size=3, attn_types=("local", "local", "global"),
        rotary_base_local=10.0, rope_type="linear", rope_factor=2.0, post_norms=True, act_fn="gelu_new",
        attn_scale=3.0,
    ),
    "gemma2ish": dict(
        n_key_value_heads=2, attn_scores_soft_cap=0.5, output_logits_soft_cap=2.0, window_size=4,
        attn_types=("local", "global", "local"), post_norms=True, act_fn="gelu_new",
    ),
    "olmo2ish": dict(n_key_value_heads=2, qk_norm="layer", pre_norms=False, post_norms=True, act_fn="silu"),
}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("newest-attention")
    tok = train_tokenizer()
    for i, (name, extra) in enumerate(SHAPES.items()):
        cfg = ModelConfig(
            n_layers=3, d_model=16, n_heads=4, d_head=8, d_vocab=tok.get_vocab_size(), n_ctx=64, attn_only=False,
            d_mlp=24, gated_mlp=True, normalization_type="RMS", positional_embedding_type="rotary", rotary_base=100.0,
            **extra,  # type: ignore[arg-type]
        )  # fmt: skip
        save_qkov(root / name, cfg, tok, seed=10 + i)
    return root


@pytest.fixture(scope="module")
def client(folders: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    empty = tmp_path_factory.mktemp("no-user-models")
    settings = Settings(shipped_dir=folders, models_dir=empty, dtype="float64", limits=LIMITS, store_url="off")
    with TestClient(create_app(settings)) as c:
        yield c


def _fill(path: str) -> str:
    values = {"head": "L1H2", "source": "L0H1", "target": "L2H3", "writer": "L0H1", "reader": "L2H3.K"}
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), "L1H2"), path)


def _params(analysis: Any) -> dict[str, Any]:
    fields = analysis.params.model_fields
    out: dict[str, Any] = {}
    for name in ("prompt", "text"):
        if name in fields:
            out[name] = PROMPT
    if "target" in fields and fields["target"].is_required():
        out["target"] = " name"
    for name in ("head", "heads"):
        if name in fields and fields[name].is_required() and "{" + name + "}" not in analysis.path:
            out[name] = "L2H1"
    return out


# Analyses that answer only where the model has what they read; random weights may lack it (the refusal names why).
REFUSED_ON_RANDOM_WEIGHTS = {"positivity": "no induction head"}
CASES = [(name, a) for name in SHAPES for a in ANALYSES if a.scope == "model"]


@pytest.mark.parametrize(("name", "analysis"), CASES, ids=[f"{n}-{a.name}" for n, a in CASES])
def test_every_analysis_answers(client: TestClient, name: str, analysis: Any) -> None:
    url = f"{API}/{name}" + _fill(analysis.path and "/" + analysis.path)
    response = client.get(url, params=_params(analysis))
    if analysis.name in REFUSED_ON_RANDOM_WEIGHTS and response.status_code == 422:  # a property of random weights
        assert REFUSED_ON_RANDOM_WEIGHTS[analysis.name] in response.json()["detail"]
        return
    assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:300]}"


@pytest.mark.parametrize("name", list(SHAPES))
def test_qk_tables_say_their_form_and_are_capped(client: TestClient, folders: Path, name: str) -> None:
    model = load_checkpoint(folders / name, dtype=torch.float64).model
    cfg = model.cfg
    body = client.get(f"{API}/{name}/heads/L1H2/qk", params={"token": "name", "offset": 2, "k": 5}).json()
    assert body["qk_form"] == ("cosine" if cfg.qk_norm else "exact") and body["qk_form_note"]
    assert body["window"] == cfg.layer_window(1)
    query = body["token"]["id"]
    row = full_qk_row_at(model, 1, 2, query, 2)  # the engine's exact token-level row (before the cap)
    cap = cfg.attn_scores_soft_cap
    for entry in body["entries"]:
        value = float(row[entry["col"]["id"]])
        expected = cap * math.tanh(value / cap) if cap is not None else value
        assert abs(entry["value"] - expected) < 1e-9
    if cap is not None:
        assert body["score_cap"] == cap


@pytest.mark.parametrize("name", list(SHAPES))
def test_qk_paths_sum_to_the_scores_the_softmax_sees(client: TestClient, name: str) -> None:
    """The QK path expansion on a prompt: terms (QK-norm frozen, cap factors frozen) sum to the model's scores on the
    entries the head sees; the page names the form, the cap and the share of scores beyond it."""
    body = client.get(f"{API}/{name}/qk-paths", params={"prompt": PROMPT, "head": "L2H1"}).json()
    assert body["max_abs_error"] < 1e-9
    cfg = SHAPES[name]
    assert body["qk_form"] == ("frozen-norm" if cfg.get("qk_norm") else "exact")
    if "attn_scores_soft_cap" in cfg:
        assert body["score_cap"] == cfg["attn_scores_soft_cap"] and 0 < body["beyond_cap"] <= 1
    window = body["window"]
    if window is not None:  # a local layer: keys beyond the window are not seen
        assert body["scores"][-1][0] is None and body["scores"][-1][-window] is not None


def test_offset_profiles_stop_at_a_sliding_layers_window(client: TestClient, folders: Path) -> None:
    """On a sliding layer the positional kernel, the QK-copying profile and a composition profile (bounded by the
    target's layer, not the source's) run over δ = 0..window - 1 only, and say the window; their peak is the engine's
    arg-max over those offsets, flagged as an edge exactly when it is the last one."""
    model = load_checkpoint(folders / "gemma2ish", dtype=torch.float64).model  # window 4 on layers 0 and 2
    cfg = model.cfg
    window = cfg.layer_window(2)
    assert window == 4 and cfg.layer_window(1) is None
    wide = torch.arange(11)
    plain = pair_profile(model, "L1H0", "L2H3", "k", wide)  # [11] the engine's values at every offset
    body = client.get(f"{API}/gemma2ish/composition/L1H0/L2H3/profile", params={"max_offset": 10}).json()
    assert body["offsets"] == list(range(window)) and body["shape"]["window"] == window
    assert max(abs(a - b) for a, b in zip(body["scores"], plain[:window].tolist(), strict=True)) < 1e-9
    peak = int(plain[:window].argmax())
    assert body["peak_offset"] == peak and body["shape"]["at_edge"] == (
        peak == window - 1 and not body["shape"]["flat"]
    )
    # a global target reads every offset asked for, whatever its source's window
    body = client.get(f"{API}/gemma2ish/composition/L0H0/L1H3/profile", params={"max_offset": 10}).json()
    assert body["offsets"] == wide.tolist() and body["shape"]["window"] is None
    for path in ("positional", "qk-copying"):
        local = client.get(f"{API}/gemma2ish/heads/L2H1/{path}", params={"max_offset": 10}).json()
        assert local["offsets"] == list(range(window)) and local["shape"]["window"] == window
        assert (
            client.get(f"{API}/gemma2ish/heads/L1H1/{path}", params={"max_offset": 10}).json()["offsets"]
            == wide.tolist()
        )


@pytest.mark.parametrize(
    "path",
    ["heads/{head}/qk", "heads/{head}/qk-copying", "heads/{head}/skip-trigrams"],
    ids=["qk", "copying", "trigrams"],
)
def test_an_offset_beyond_a_sliding_window_is_refused_by_name(client: TestClient, path: str) -> None:
    """δ = window on a sliding layer is an offset the head never attends: refused with the window named; the same
    offset on the global layer answers."""
    params: dict[str, str | int] = {"offset": 4, "token": "name"}
    refused = client.get(f"{API}/gemma2ish/{path.format(head='L2H1')}", params=params)
    assert refused.status_code == 422 and "4-token window" in refused.json()["detail"], refused.text[:300]
    assert client.get(f"{API}/gemma2ish/{path.format(head='L1H1')}", params=params).status_code == 200


def _share_past(capped: torch.Tensor, cap: float) -> float:
    """The share of entries whose value before the cap was beyond ±c, read back from the capped values: |s| > c
    exactly when |c·tanh(s/c)| > c·tanh(1)."""
    return float((capped.abs() > cap * math.tanh(1.0)).double().mean())


def test_prompt_pages_show_the_share_of_scores_and_logits_beyond_the_cap(client: TestClient, folders: Path) -> None:
    """Gemma 2-shaped: the prompt's patterns give each head's share of seen scores beyond the score cap, the path
    expansion the share of the position's logits beyond the logit cap; both against the model's capped outputs (the
    window drawn by hand), and both on the HTML page."""
    loaded = load_checkpoint(folders / "gemma2ish", dtype=torch.float64)
    model, cfg = loaded.model, loaded.model.cfg
    heads = ["L0H1", "L1H2"]  # a sliding layer (window 4) and a global one
    body = client.get(f"{API}/gemma2ish/prompt", params={"prompt": PROMPT, "heads": ",".join(heads)}).json()
    ids = torch.tensor([[t["id"] for t in body["tokens"]]])
    logits, cache = model.run(ids, names=lambda name: name.endswith("hook_attn_scores"))
    n = ids.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    score_cap, logit_cap = cfg.attn_scores_soft_cap, cfg.output_logits_soft_cap
    assert score_cap is not None and logit_cap is not None and body["score_cap"] == score_cap
    for hp, (layer, h) in zip(body["heads"], [(0, 1), (1, 2)], strict=True):
        window = cfg.layer_window(layer) or n
        seen = (j <= i) & (i - j < window)
        capped = cache[f"blocks.{layer}.attn.hook_attn_scores"][0, h][seen]
        assert abs(hp["beyond_cap"] - _share_past(capped, score_cap)) < 1e-12
    paths = client.get(f"{API}/gemma2ish/paths", params={"prompt": PROMPT}).json()
    assert paths["logit_cap"] == logit_cap
    assert abs(paths["beyond_cap"] - _share_past(logits[0, -1], logit_cap)) < 1e-12
    page = client.get("/models/gemma2ish/prompt", params={"prompt": PROMPT, "heads": ",".join(heads)}).text
    assert (
        'id="score-cap"' in page
        and f'{heads[0]} <span class="mono">{100 * body["heads"][0]["beyond_cap"]:.1f} %' in page
    )
    assert 'id="logit-cap"' in page and f"{100 * paths['beyond_cap']:.2f} %" in page
    qk_page = client.get("/models/gemma2ish/qk-paths", params={"prompt": PROMPT, "head": "L2H1"}).text
    qk = client.get(f"{API}/gemma2ish/qk-paths", params={"prompt": PROMPT, "head": "L2H1"}).json()
    assert 'id="score-cap"' in qk_page and f"{100 * qk['beyond_cap']:.1f} %" in qk_page
    plain = client.get("/models/gemma3ish/prompt", params={"prompt": PROMPT}).text  # no caps: no such notes
    assert 'id="score-cap"' not in plain and 'id="logit-cap"' not in plain


def test_a_capped_qk_row_gives_the_share_of_its_scores_beyond_the_cap(client: TestClient, folders: Path) -> None:
    """A token's QK row (and column) on a score-capped model: the share of its whole vocabulary's scores beyond ±c
    before the cap, against the factored circuit's row, and on the head page."""
    model = load_checkpoint(folders / "gemma2ish", dtype=torch.float64).model
    cap = model.cfg.attn_scores_soft_cap
    assert cap is not None
    circuit = full_qk_circuit_at(model, 1, 2, 2)  # [V, V] factored, at δ = 2, before the cap
    shares = {}
    for side in ("query", "key"):
        body = client.get(
            f"{API}/gemma2ish/heads/L1H2/qk", params={"token": "name", "offset": 2, "k": 5, "side": side}
        ).json()
        t = body["token"]["id"]
        scores = circuit.rows([t])[0] if side == "query" else circuit.cols([t])[0]
        expected = float((scores.abs() > cap).double().mean())
        assert abs(body["beyond_cap"] - expected) < 1e-12
        assert side == "key" or 0 < expected < 1  # (the query's row is partly beyond: not a share that holds anyway)
        shares[side] = body["beyond_cap"]
    page = client.get("/models/gemma2ish/heads/L1H2", params={"token": "name", "offset": 2}).text
    assert 'id="qk-score-cap"' in page and f"{100 * shares['query']:.1f} %" in page
    assert client.get(f"{API}/gemma2ish/heads/L1H2/qk", params={"k": 5}).json()["beyond_cap"] is None  # no row


# Every analysis whose answer holds QK numbers, and the level they are at (docs/maths.md §7.1's table): token tables and
# the positional kernel (a query and a key both μ_l, with μ_l's own scales) at token level; composition, virtual
# weights, eigenvalue and singular values (the heads table's and a head's QK copying), band energies and the QK norms
# at weight level; the QK path expansion at prompt level.
QK_LEVELS = {
    "qk": "token", "skip-trigrams": "token", "positional": "token",
    "composition": "weight", "composition-pair": "weight", "composition-profile": "weight",
    "qk-copying-offset": "weight", "rotary-bands": "weight", "qk-circuit-norm": "weight", "qk-symmetry": "weight",
    "residual": "weight", "residual-pair": "weight", "positivity": "weight", "heads": "weight",
    "head": "weight",
    "qk-paths": "prompt",
}  # fmt: skip
FORM_UNDER_QK_NORM = {"token": "cosine", "weight": "bilinear", "prompt": "frozen-norm"}
OV_TABLES = {"direct", "ov", "expert-ov"}  # token tables with the QK table's schema: their qk_form is null


def test_the_analyses_that_say_a_qk_form_are_those_with_qk_numbers() -> None:
    said = {a.name for a in ANALYSES if a.scope == "model" and "qk_form" in a.view.model_fields}
    assert said == set(QK_LEVELS) | OV_TABLES


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_qk_number_says_its_form(client: TestClient, name: str) -> None:
    """Each analysis with QK numbers says their form: 'exact' without QK-norm, else the form of its level."""
    qk_norm = SHAPES[name].get("qk_norm") is not None
    for analysis in ANALYSES:
        if analysis.name not in QK_LEVELS.keys() | OV_TABLES:
            continue
        url = f"{API}/{name}" + _fill("/" + analysis.path)
        params = _params(analysis) | ({"kind": "K"} if analysis.name == "composition" else {})
        response = client.get(url, params=params)
        if analysis.name in REFUSED_ON_RANDOM_WEIGHTS and response.status_code == 422:
            continue
        assert response.status_code == 200, (url, response.text[:300])
        level = QK_LEVELS.get(analysis.name)
        expected = None if level is None else FORM_UNDER_QK_NORM[level] if qk_norm else "exact"
        assert response.json()["qk_form"] == expected, url


def test_the_model_says_what_is_exact_and_what_is_frozen(client: TestClient) -> None:
    """The model's summary and page say, per feature of its attention, which numbers are exact and which frozen."""
    expected = {  # (feature, what its sentence must say) for each shape, from SHAPES by hand
        "gemma3ish": [("QK-norm (over each head)", "frozen-norm"), ("Sliding windows (2 of 3 layers, 3 tokens)", ""),
                      ("Output norms", "freeze")],
        "gemma2ish": [("Soft caps (scores at 0.5 and logits at 2)", "cap factor"),
                      ("Sliding windows (2 of 3 layers, 4 tokens)", ""), ("Output norms", "freeze")],
        "olmo2ish": [("QK-norm (over all heads of a layer at once)", "cosine"), ("Output norms", "freeze")],
    }  # fmt: skip
    for name, features in expected.items():
        said = client.get(f"{API}/{name}").json()["exactness"]
        assert [line.split(":")[0] for line in said] == [feature for feature, _ in features], said
        assert all(words in line for line, (_, words) in zip(said, features, strict=True)), said
        page = client.get(f"/models/{name}").text
        assert 'id="exactness"' in page and all(line.replace("'", "&#39;") in page for line in said), name
