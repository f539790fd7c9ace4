"""One rule for "the heads that matter" (circuits_core.prompt.detectors.heads_that_matter): the strongest induction head
of layers >= 1 and the strongest previous-token head of an earlier layer, from the model's own scores. It sets the
heads JSON (previous_token_head, induction_head), the heads table's K-composition column, the model summary computed
on first use, and the default heads of the prompt, chain and QK-paths pages.

Checked on toy-2l against the rule applied by enumeration to the answer's own scores, K-composition positivity
recomputed densely in float64 for every later head, and the summary's repeat losses against a plain forward pass;
on SmolLM2 (a bare GGUF folder, no model_summary.json) against the pair the stored summary (measured by
`make smollm2` through another code path, checked against transformers) names.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.summary_file import load_summary
from circuits_core.prompt.model_summary import measure
from circuits_core.prompt.qk_paths import circuit_positivity, k_composition_circuit
from tests.app.conftest import until_done

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "checkpoints"
SMOLLM2 = ROOT / "models" / "smollm2-135m"


def rule_by_enumeration(heads: list[dict[str, Any]]) -> tuple[str, str]:
    scored = [h for h in heads if h["induction"] is not None and h["layer"] >= 1]
    induction = max(scored, key=lambda h: h["induction"])
    earlier = [h for h in heads if h["previous_token"] is not None and h["layer"] < induction["layer"]]
    return max(earlier, key=lambda h: h["previous_token"])["head"], induction["head"]


def page_heads(c: TestClient, model: str, page: str) -> list[str]:
    """The heads a page's form opens on (its heads / head input's value)."""
    text = until_done(c, f"/models/{model}/{page}").text
    return re.findall(r'name="heads?"[^>]*value="([^"]*)"', text)


def test_toy_2l_heads_that_matter_set_every_default(tmp_path: Path) -> None:
    settings = Settings(store_url="off", dtype="float64", models_dir=None)
    with TestClient(create_app(settings)) as c:
        view = c.get("/api/v1/models/toy-2l/heads").json()
        prev, induction = rule_by_enumeration(view["heads"])
        assert (view["previous_token_head"], view["induction_head"]) == (prev, induction)
        assert "strongest induction head" in view["heads_rule"]

        # the K-composition column is measured against that head: dense float64 positivity of every later head
        model = load_checkpoint(SHIPPED / "toy-2l", dtype=torch.float64).model
        pl, ph = int(prev[1 : prev.index("H")]), int(prev[prev.index("H") + 1 :])
        for h in view["heads"]:
            if h["layer"] > pl:
                ref = circuit_positivity(k_composition_circuit(model, (h["layer"], h["index"]), (pl, ph)))
                assert h["qk_k_composition"] == pytest.approx(ref, abs=1e-9), h["head"]

        # the pages open on them
        assert page_heads(c, "toy-2l", "prompt")[0] == f"{prev},{induction}"
        assert page_heads(c, "toy-2l", "path")[0] == f"{prev},{induction}"
        assert page_heads(c, "toy-2l", "qk-paths")[0] == induction

        # the summary, computed on first use: the same heads, and the losses of a plain forward pass
        summary = c.get("/api/v1/models/toy-2l/summary").json()
        assert (summary["previous_token_head"], summary["induction_head"]) == (prev, induction)
        meta = view["detector_input"]
        from circuits_core.prompt.detectors import repeated_random_tokens

        tokens = repeated_random_tokens(model.cfg.d_vocab, meta["seq_len"], meta["batch"], meta["seed"], meta["bos"])
        with torch.no_grad():
            logp = model(tokens).log_softmax(-1)  # [b, n, V]
        nll = -logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]  # [b, n - 1]
        t = meta["seq_len"]
        assert summary["loss_first_copy"] == pytest.approx(float(nll[:, :t].mean()), abs=1e-9)
        assert summary["loss_second_copy"] == pytest.approx(float(nll[:, t:].mean()), abs=1e-9)
        assert summary["loss_second_copy"] < summary["loss_first_copy"]  # toy-2l has induction heads
        listed = {h["head"] for h in summary["induction_heads"]}
        assert listed == {h["head"] for h in view["heads"] if (h["induction"] or 0) >= summary["head_threshold"]}


@pytest.mark.slow
@pytest.mark.skipif(not list(SMOLLM2.glob("*.gguf")), reason="SmolLM2-135M not fetched (make smollm2)")
def test_smollm2_heads_that_matter_from_its_own_scores(tmp_path: Path) -> None:
    """SmolLM2 as a bare GGUF folder: the heads JSON names the pair that its summary's scores give by the rule (the
    summary of `make smollm2`: stored model_summary.json, else measured here through model_summary.measure, which
    does not go through the app; L16H0 -> L18H6 when measured, read from the scores, not named by the test)."""
    stored = load_summary(SMOLLM2) or measure(load_checkpoint(SMOLLM2, process=False))  # make smollm2's path
    ind, prev = stored["induction_scores"], stored["previous_token_scores"]
    as_heads = [
        {"head": f"L{layer}H{h}", "layer": layer, "induction": ind[layer][h], "previous_token": prev[layer][h]}
        for layer in range(len(ind))
        for h in range(len(ind[0]))
    ]
    expected = rule_by_enumeration(as_heads)
    bare = tmp_path / "models" / "smollm2-135m"
    bare.mkdir(parents=True)
    for gguf in SMOLLM2.glob("*.gguf"):
        shutil.copy(gguf, bare / gguf.name)
    settings = Settings(store_url="off", models_dir=tmp_path / "models")
    with TestClient(create_app(settings)) as c:
        view = until_done(c, "/api/v1/models/smollm2-135m/heads").json()
        assert (view["previous_token_head"], view["induction_head"]) == expected
        assert rule_by_enumeration(view["heads"]) == expected
        summary = until_done(c, "/api/v1/models/smollm2-135m/summary").json()
        assert summary["loss_first_copy"] == pytest.approx(stored["loss_first_copy"], abs=0.02)
        assert summary["loss_second_copy"] == pytest.approx(stored["loss_second_copy"], abs=0.02)
        assert page_heads(c, "smollm2-135m", "qk-paths")[0] == expected[1]
