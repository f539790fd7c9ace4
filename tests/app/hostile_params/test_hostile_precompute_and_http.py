"""Hostile pass over the same parameters outside the in-process API (test_hostile_vocab_basis_params.py has the
requests): precompute's command line and its crawl of edge models (pages, API twins, lazy panels), the new refusals over
real HTTP (uvicorn on loopback), and the term-importance page's ablation sentence on the measured previous-token scores
of toy-2l's card and SmolLM2's summary (a weak layer-0 head must not be called a previous-token head). Same model
folders.
"""

from __future__ import annotations

import html
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from app.precompute import main as precompute
from app.settings import REPO_ROOT
from bench.server import free_port
from tests.app.conftest import until_done
from tests.app.hostile_folders import API
from tests.app.live_server import start

# -- 8. a page sentence on a model whose layer 0 has no previous-token head -----------------------------------
SMOLLM2_SUMMARY = REPO_ROOT / "models" / "smollm2-135m" / "model_summary.json"
TOY2L_CARD = REPO_ROOT / "checkpoints" / "toy-2l" / "model_card.json"


def _rule(induction: list[list[float]], previous: list[list[float]]) -> tuple[str, str]:
    """The heads that matter, brute force (HEADS_RULE): the strongest induction head of layers >= 1, and the strongest
    previous-token head of an earlier layer."""
    _, il, ih = max((s, layer, h) for layer, row in enumerate(induction) if layer >= 1 for h, s in enumerate(row))
    _, pl, ph = max((s, layer, h) for layer, row in enumerate(previous[:il]) for h, s in enumerate(row))
    return f"L{pl}H{ph}", f"L{il}H{ih}"


def _ablation_sentence_on(induction: list[list[float]], previous: list[list[float]]) -> tuple[str | None, str]:
    """ablation_sentence with a model's measured scores [L][H] (every head's ablation row present) and the heads view's
    previous-token head chosen by the rule; returns the sentence and that head."""
    from app.schemas import HeadScores, HeadsView
    from app.schemas.analyses import HeadAblation, TermImportanceView
    from app.views.shared.page_claims import ablation_sentence

    heads = [HeadScores.model_construct(head=f"L{layer}H{h}", layer=layer, index=h, previous_token=s)
             for layer, row in enumerate(previous) for h, s in enumerate(row)]  # fmt: skip
    rows = [HeadAblation(head=x.head, loss_change=0.01, loss_change_recomputed=0.5) for x in heads]
    prev, induction_head = _rule(induction, previous)
    view = HeadsView.model_construct(heads=heads, previous_token_head=prev, induction_head=induction_head)
    return ablation_sentence(TermImportanceView.model_construct(heads=rows), view), prev


def test_the_ablation_sentence_names_toy_2ls_previous_token_head() -> None:
    card = json.loads(TOY2L_CARD.read_text())["phenomena"]
    said, prev = _ablation_sentence_on(card["induction_scores"], card["previous_token_scores"])
    assert prev == "L0H5" and said is not None and "previous-token head L0H5" in said  # the card's L0H5 (0.97)
    weak = [[0.1 if (layer, h) == (0, 5) else s for h, s in enumerate(row)]
            for layer, row in enumerate(card["previous_token_scores"])]  # fmt: skip
    said, prev = _ablation_sentence_on(card["induction_scores"], weak)
    assert said is None or prev not in said  # a head below the threshold is never called a previous-token head


@pytest.mark.skipif(not SMOLLM2_SUMMARY.exists(), reason="SmolLM2-135M not fetched (make smollm2)")
def test_the_ablation_sentence_calls_no_weak_head_a_previous_token_head_on_smollm2() -> None:
    """SmolLM2's layer 0 has no previous-token head (best 0.11 < the summary's 0.4): the sentence names the rule's
    previous-token head (the strongest one before the strongest induction head), which must reach the threshold."""
    summary = json.loads(SMOLLM2_SUMMARY.read_text())
    scores = summary["previous_token_scores"]
    assert max(scores[0]) < summary["head_threshold"]  # layer 0 of SmolLM2 has no previous-token head
    said, prev = _ablation_sentence_on(summary["induction_scores"], scores)
    layer, h = (int(x) for x in prev[1:].split("H"))
    if scores[layer][h] < summary["head_threshold"]:
        assert said is None, said
    else:
        named = re.search(r"previous-token head L(\d+)H(\d+)", said or "")
        assert named is not None and f"L{named[1]}H{named[2]}" == prev, said


def k_composition_gram(m: Any, src: tuple[int, int], dst: tuple[int, int]) -> float:
    """‖W_OV W_QKᵀ‖_F / (‖W_OV‖_F ‖W_QK‖_F), row convention, written out through d_head x d_head Grams (float64):
    ‖W_V M W_Qᵀ‖² = tr(Mᵀ (W_VᵀW_V) M (W_QᵀW_Q)) with M = W_O W_K, ‖W_V W_O‖² = tr(W_VᵀW_V W_O W_Oᵀ)."""
    W_V, W_O, W_Q, W_K = m.W_V[src], m.W_O[src], m.W_Q[dst], m.W_K[dst]
    M, G_V, G_Q = W_O @ W_K, W_V.T @ W_V, W_Q.T @ W_Q
    num = torch.trace(M.T @ G_V @ M @ G_Q)
    return float((num / (torch.trace(G_V @ W_O @ W_O.T) * torch.trace(G_Q @ W_K.T @ W_K))).sqrt())


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Any]:
    """One app serving the fetched SmolLM2 (the heads table, computed once, is shared by both pages below)."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    if not SMOLLM2_SUMMARY.exists():
        pytest.skip("SmolLM2-135M not fetched (make smollm2)")
    with TestClient(create_app(Settings(store_url="off", models_dir=SMOLLM2_SUMMARY.parent.parent))) as c:
        yield c


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_composition_page_sentence(smollm2: Any) -> None:
    """The composition page's measured sentence on SmolLM2: its induction and previous-token heads and scores agree
    with model_summary.json (checked against transformers in tests/core/test_smollm2.py), its K-composition partner
    is the best earlier head by score minus 1/√d_model, computed here from the served (processed) weights."""
    from circuits_core.formats.checkpoint import load_checkpoint

    summary = json.loads(SMOLLM2_SUMMARY.read_text())
    until_done(smollm2, "/api/v1/models/smollm2-135m/heads")  # the sentence reads the heads table (a job here)
    page = until_done(smollm2, "/models/smollm2-135m/composition", params={"kind": "K"}).text
    lazy = re.search(r'<section class="panel" id="composition-lazy"[^>]*>', page)
    assert lazy, "SmolLM2's heat maps are priced over FRAME_FIRST_S: the page is a frame with the panel after it"
    src = html.unescape(re.search(r'hx-get="([^"]+)"', lazy[0])[1])  # type: ignore[index]
    page = until_done(smollm2, src, headers={"HX-Request": "true", "HX-Target": "composition-lazy"}).text  # as htmx
    said = html.unescape(re.search(r'id="composition-claim">(.*?)</p>', page, re.S)[1])  # type: ignore[index]
    num = r"([+-]?\d+\.\d+)"
    found = re.search(
        rf"strongest induction head is L(\d+)H(\d+) \(induction score {num} on 10 sequences of BOS \+ r \+ r\); "
        rf"its strongest K-composition partner is L(\d+)H(\d+) \({num}, {num} over the baseline\)[,;] the strongest "
        rf"previous-token head of the earlier layers (?:is L(\d+)H(\d+) )?\(score {num}\)",
        said,
    )
    assert found, said
    layer, head = int(found[1]), int(found[2])
    induction = summary["induction_scores"]
    best = max(
        ((lay, h) for lay in range(1, len(induction)) for h in range(len(induction[lay]))),
        key=lambda x: induction[x[0]][x[1]],
    )
    assert (layer, head) == best and float(found[3]) == pytest.approx(induction[layer][head], abs=0.006)
    prev = summary["previous_token_scores"]
    best_prev = max(((lay, h) for lay in range(layer) for h in range(len(prev[lay]))), key=lambda x: prev[x[0]][x[1]])
    named = (
        (int(found[8]), int(found[9])) if found[8] else (int(found[4]), int(found[5]))
    )  # ", the strongest ..." names the partner
    assert named == best_prev and float(found[10]) == pytest.approx(prev[best_prev[0]][best_prev[1]], abs=0.006)
    m = load_checkpoint(SMOLLM2_SUMMARY.parent, dtype=torch.float64).model
    with torch.no_grad():
        scores = {
            (lay, h): k_composition_gram(m, (lay, h), (layer, head))
            for lay in range(layer)
            for h in range(m.cfg.n_heads)
        }
    partner = max(scores, key=lambda s: scores[s])
    assert (int(found[4]), int(found[5])) == partner, (said, partner)
    assert float(found[6]) == pytest.approx(scores[partner], abs=1e-3)
    assert float(found[7]) == pytest.approx(scores[partner] - m.cfg.d_model**-0.5, abs=1e-3)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_overview_scatter_uses_a_previous_token_head(smollm2: Any) -> None:
    summary = json.loads(SMOLLM2_SUMMARY.read_text())
    page = until_done(smollm2, "/models/smollm2-135m").text  # after its heads-table job, when it runs as one
    assert 'id="scatter-claim"' in page, "no scatter sentence on SmolLM2's overview: this check would test nothing"
    found = re.search(r"K-composition positivity with previous-token head L(\d+)H(\d+)", page)
    assert found, "the scatter names no previous-token head"
    score = summary["previous_token_scores"][int(found[1])][int(found[2])]
    assert score >= summary["head_threshold"], f"L{found[1]}H{found[2]} scores {score} as a previous-token head"


def test_default_seq_len_also_fits_this_servers_max_seq_len(folders: tuple[Path, Path]) -> None:
    """A server with max_seq_len 5: the default is shortened to 5 (not the 15 n_ctx allows), an explicit 6 is refused
    naming the bound, and the page agrees."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings
    from tests.app.conftest import LIMITS, assert_problem

    settings = Settings(shipped_dir=folders[0], models_dir=folders[1], dtype="float64", store_url="off",
                        limits=LIMITS.model_copy(update={"max_seq_len": 5}))  # fmt: skip
    with TestClient(create_app(settings)) as c:
        assert c.get(f"{API}/two/detectors").json()["detector_input"]["seq_len"] == 5
        assert_problem(c.get(f"{API}/two/detectors", params={"seq_len": 6}), 422, "seq_len", "5")
        page = c.get("/models/two/detectors")
        assert page.status_code == 200 and 'name="seq_len" value="5"' in page.text.replace("'", '"')


# -- 9. precompute's command line --------------------------------------------------------------------------------
@pytest.fixture
def store_env(tmp_path: Path, folders: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "QKOV_STORE_URL": "disk",
        "QKOV_STORE_DIR": str(tmp_path / "store"),
        "QKOV_SHIPPED_DIR": str(folders[0]),
        "QKOV_MODELS_DIR": str(folders[1]),
        "QKOV_DTYPE": "float64",
    }.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["nope"], "unknown model"),
        (["two", "--heads", "L9H0"], "L9H0"),
        (["two", "--heads", "x"], "not of the form"),
        (["zero", "--heads", "L0H0"], "0 layers"),
    ],
)
def test_precompute_refuses_bad_arguments_by_name(store_env: None, capsys: pytest.CaptureFixture[str], argv: list[str],
                                                  needle: str) -> None:  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        precompute(argv)
    assert stop.value.code == 2 and needle in capsys.readouterr().err


def test_precompute_refuses_an_overlong_head_name(store_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        precompute(["two", "--heads", "L" + "0" * 20 + "H0"])
    assert stop.value.code == 2 and "head" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["zero", "ctx2", "rope", "wide"])
def test_precompute_crawls_edge_models_without_a_server_error(store_env: None, capsys: pytest.CaptureFixture[str],
                                                              model: str) -> None:  # fmt: skip
    """Every page, API twin and lazy panel precompute asks of an edge model is answered or refused with a 4xx."""
    assert precompute([model]) == 0
    out = capsys.readouterr().out
    assert f"{model}: " in out and " pages, " in out, out
    assert not re.search(r"\(5\d\d\)", out), out


# -- 10. the same over real HTTP ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(folders: tuple[Path, Path]) -> Iterator[str]:
    port = free_port()
    env = {
        "QKOV_SHIPPED_DIR": str(folders[0]),
        "QKOV_MODELS_DIR": str(folders[1]),
        "QKOV_STORE_URL": "off",
        "QKOV_DTYPE": "float64",
        "QKOV_COMPUTE_SLOTS": "1",
        "QKOV_TORCH_THREADS": "1",
        "QKOV_MAX_MODEL_BYTES": str(10**9),
    }
    proc: subprocess.Popen[bytes] = start(["-m", "app.serve", "--port", str(port)], port, env, quiet=True)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(10)


RAW_HTTP = [("two/heads/L0H0/ov?vocab=ALL", 422, "vocab"), ("two/copying?rows=0", 422, "rows"),
            ("two/copying?heads=" + "%2C".join(["L0H0"] * 17), 422, "at most"), ("two/copying?rows=%00", 422, "rows"),
            ("rope/heads/L0H0/qk-copying?max_offset=4097", 422, "max_offset"), ("rope/heads/L0H0/qk-copying?offset=32", 422, "32"),  # noqa: E501 (a table kept on one line)
            ("two/heads/L0H0/qk-copying", 422, "rotary"), ("ln/composition?basis=%F0%9F%92%A9", 422, "basis"),
            ("ctx2/detectors", 422, "seq_len"), ("two/direct?min_count=all", 422, "min_count"),
            ("rope/heads/L0H0/qk-copying?offset=3&max_offset=8", 200, "eigenvalues")]  # fmt: skip


def test_over_real_http(server: str) -> None:
    with httpx.Client(base_url=server, timeout=60) as http:
        for path, status, needle in RAW_HTTP:
            answer = http.get(f"{API}/{path}")
            assert answer.status_code == status, (path, answer.status_code, answer.text[:300])
            assert needle in answer.text, (path, answer.text[:300])
            if status >= 400:
                assert answer.headers["content-type"].startswith("application/problem+json"), path
        body = http.get(f"{API}/rope/heads/L0H0/qk-copying?offset=3&max_offset=8").json()
        assert body["offset"] == 3 and body["offsets"] == list(range(9)) and len(body["eigenvalues"]) == 8
