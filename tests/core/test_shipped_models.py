"""The committed toy models (checkpoints/) show the paper's phenomena, and their model cards say what the
code measures now. Thresholds are the issue's; measurements come from circuits_core.phenomena."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from circuits_core.corpus import manifest_digest
from circuits_core.errors import CheckpointError
from circuits_core.phenomena import (
    THRESHOLDS,
    TOKEN_COUNTS_FILE,
    EvalData,
    check_thresholds,
    load_token_counts,
    measure,
)
from circuits_core.training import RECIPES, load_toy

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"
NAMES = ["toy-0l", "toy-1l", "toy-2l"]
TWO_LAYER = [name for name in NAMES if RECIPES[name].n_layers >= 2]  # models with an earlier and a later layer


@pytest.fixture(scope="module")
def eval_data() -> EvalData:
    return EvalData.load(ROOT / "eval_data.npz")


@pytest.fixture(scope="module")
def shipped(request, eval_data):
    """(name, model, card, measurement) of the model named by the test's indirect parametrisation."""
    torch.set_num_threads(1)
    model, tokenizer, card = load_toy(ROOT / request.param)
    return request.param, model, card, measure(model, tokenizer, eval_data)


@pytest.mark.parametrize("shipped", NAMES, indirect=True)
def test_card_matches_measurement(shipped):
    name, model, card, now = shipped
    assert card["name"] == name
    for key, value in card["phenomena"].items():
        if isinstance(value, float):
            assert now[key] == pytest.approx(value, rel=1e-3, abs=1e-4), key
        elif isinstance(value, str | int):
            assert now[key] == value, key
    for key, verdict in card["thresholds"].items():
        assert verdict["value"] == pytest.approx(now[key], rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("shipped", NAMES, indirect=True)
def test_thresholds_met(shipped):
    name, model, card, now = shipped
    checks = check_thresholds(model.cfg.n_layers, now)
    assert set(checks) == set(THRESHOLDS[model.cfg.n_layers])
    assert all(checks.values()), checks
    if name == "toy-2l":  # the numbers, spelled out
        assert now["induction_score"] >= 0.6 and now["induction_head"].startswith("L1")
        assert now["partner_previous_token_score"] >= 0.5 and now["k_composition_partner"].startswith("L0")
        assert now["rep1_loss"] - now["rep2_loss"] >= 2.0
        assert now["icl_score"] < 0
    if name == "toy-1l":
        assert sum(s > 0 for s in now["ov_copying_scores"][0]) >= 0.75 * model.cfg.n_heads
        example = now["skip_trigrams"]["copying_examples"][0]  # the listing shows a copying skip-trigram
        assert example["source"].lstrip(" ") == example["boosted"].lstrip(" ")


@pytest.mark.parametrize("shipped", TWO_LAYER, indirect=True)
def test_k_composition_partner_against_dense(shipped):
    """The partner from composition.py (QR collapse) is the argmax of the dense float64 formula."""
    name, model, card, now = shipped
    assert model.cfg.n_layers >= 2
    head = int(now["induction_head"][3:])
    W_QK = (model.W_Q[1, head].double() @ model.W_K[1, head].double().T)  # [d, d]
    W_OV = model.W_V[0].double() @ model.W_O[0].double()  # [H, d, d]
    dense = torch.linalg.matrix_norm(W_QK @ W_OV.transpose(1, 2)) / (torch.linalg.matrix_norm(W_QK) * torch.linalg.matrix_norm(W_OV))
    assert now["k_composition_partner"] == f"L0H{int(dense.argmax())}"


@pytest.mark.parametrize("shipped", NAMES, indirect=True)
def test_card_records_recipe_data_and_training(shipped):
    name, model, card, now = shipped
    recipe = card["recipe"]
    assert recipe["steps"] == RECIPES[name].steps == card["training"]["steps"]
    assert recipe["batch"] == RECIPES[name].batch and recipe["repeat_frac"] == RECIPES[name].repeat_frac
    manifest = json.loads((ROOT / "corpus_manifest.json").read_text())
    assert card["data"]["manifest_sha256"] == manifest_digest(manifest["files"])
    assert card["data"]["train_tokens"] > 1_000_000 and card["data"]["val_files"] == sum(f["val"] for f in manifest["files"])
    for key in ("wall_seconds", "device", "final_train_loss"):
        assert card["training"][key] is not None
    tracked = [key for key in THRESHOLDS[model.cfg.n_layers] if key in card["history"][-1]]  # measured during training
    assert tracked
    for key in tracked:
        assert key in card["first_crossed"], key


def test_weights_small():
    total = sum(p.stat().st_size for name in NAMES for p in (ROOT / name).glob("*.safetensors"))
    assert total < 20_000_000


@pytest.mark.parametrize("name", NAMES)
def test_token_counts_file_is_the_training_counts(name, eval_data, tmp_path):
    counts = load_token_counts(ROOT / name, len(eval_data.train_counts))
    assert counts is not None and counts.dtype == np.int64
    assert np.array_equal(counts, eval_data.train_counts)
    assert (ROOT / name / TOKEN_COUNTS_FILE).stat().st_size < 50_000
    assert load_token_counts(tmp_path, 4096) is None  # no file: no counts
    np.save(tmp_path / TOKEN_COUNTS_FILE, np.ones(7))
    with pytest.raises(CheckpointError):  # wrong shape and dtype
        load_token_counts(tmp_path, 4096)
