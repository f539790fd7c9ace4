"""qkov reads the checkpoints TransformerLens wrote (tests/core/tl_reference.py): the state dict round trip without
TL's buffers, unprocessed logits and patterns equal to TL's in float64, config fields qkov does not implement
refused by name, TL's unset attention scale, and the processing chosen by qkov.json. The conventions:
test_vs_transformer_lens.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.transformer_lens import TL_BUFFERS
from tests.core.tl_reference import (
    ALL,
    BASE,
    LOOSE,
    TIGHT,
    TOKENS,
    assert_close,
    load_qkov,
    qkov_run,
    tl_processed,
)

# -- files: the loader reads what TL wrote, drops TL's buffers, ignores unknown config fields -------------
pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip_drops_tl_buffers(world: dict[str, dict[str, Any]], name: str) -> None:
    raw = world[name]["raw"]
    buffers = [k for k in raw if k.endswith(TL_BUFFERS)]
    assert buffers, "TransformerLens's state dict should carry its attn.mask / IGNORE buffers"
    config = json.loads((world[name]["pth"] / "config.json").read_text())
    assert {"dtype", "device", "NTK_by_parts_factor", "init_mode"} <= set(config)  # unknown fields are kept
    for kind in ("pth", "st"):
        loaded = load_checkpoint(world[name][kind], dtype=torch.float64, process=False)
        assert loaded.format == "transformer_lens"
        sd = loaded.model.state_dict()
        assert set(sd) == set(raw) - set(buffers)
        for key, value in sd.items():
            assert value.dtype == torch.float64
            assert torch.equal(value, raw[key].to(torch.float64)), key
        assert loaded.model.cfg.normalization_type == world[name]["tl"].cfg.normalization_type
    assert load_qkov(world, name).processing.get("fold_ln") is not True  # process=False applies nothing


# -- forward pass -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_unprocessed_logits_and_patterns_match(world: dict[str, dict[str, Any]], name: str) -> None:
    ref = world[name]["tl"]
    model = load_qkov(world, name, kind="st")
    logits, cache = qkov_run(model, TOKENS)
    tl_logits, tl_cache = ref.run_with_cache(TOKENS)
    assert_close(logits, tl_logits, TIGHT, "logits")
    assert_close(logits.log_softmax(-1), tl_logits.log_softmax(-1), TIGHT, "log-probs")
    for layer in range(model.cfg.n_layers):
        assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], tl_cache["pattern", layer], TIGHT, f"pattern L{layer}")
        if model.cfg.normalization_type is not None:
            key = f"blocks.{layer}.ln1.hook_scale"
            assert_close(cache[key], tl_cache[key], TIGHT, key)


# -- config.json fields qkov does not implement are refused, not silently ignored ----------------------
@pytest.mark.parametrize(
    "field, value",
    [("attention_dir", "bidirectional"), ("attn_scores_soft_cap", 50.0), ("output_logits_soft_cap", 30.0),
     ("clip_qkv", 8.0), ("use_logn_attn", True), ("use_NTK_by_parts_rope", True), ("use_qk_norm", True),
     ("post_embedding_ln", True), ("use_normalization_before_and_after", True), ("num_experts", 4),
     ("scale_attn_by_inverse_layer_idx", True), ("use_local_attn", True), ("gated_mlp", True)],
)  # fmt: skip
def test_unimplemented_tl_features_are_refused(
    world: dict[str, dict[str, Any]], tmp_path: Path, field: str, value: object
) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    config = json.loads((world["attn2_std_ln"]["pth"] / "config.json").read_text())
    (folder / "model.pth").write_bytes((world["attn2_std_ln"]["pth"] / "model.pth").read_bytes())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(CheckpointError, match=field):
        load_checkpoint(folder, process=False)


def test_unset_tl_attn_scale_means_sqrt_d_head(world: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """A hand-written config with TL's unresolved default attn_scale=-1.0 still scales by sqrt(d_head)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    config = json.loads((world["attn2_std_ln"]["pth"] / "config.json").read_text())
    (folder / "model.pth").write_bytes((world["attn2_std_ln"]["pth"] / "model.pth").read_bytes())
    (folder / "config.json").write_text(json.dumps({**config, "attn_scale": -1.0}))
    model = load_checkpoint(folder, dtype=torch.float64, process=False).model
    assert model.cfg.scale == math.sqrt(BASE["d_head"])
    assert_close(model.run(TOKENS)[0], world["attn2_std_ln"]["tl"](TOKENS), TIGHT, "logits")


# -- choosing the processing: load_checkpoint(process=...) or a qkov.json next to the checkpoint -------
def test_processing_is_chosen_by_qkov_json(world: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    source = world["attn2_std_ln"]["st"]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((source / name).read_bytes())
    ref = world["attn2_std_ln"]["tl"]
    default = load_checkpoint(folder, dtype=torch.float64)  # no qkov.json: TL's from_pretrained defaults
    assert all(default.model.processing[k] is True for k in ("fold_ln", "center_writing_weights", "center_unembed"))
    (folder / "qkov.json").write_text(json.dumps({"processing": False}))
    raw = load_checkpoint(folder, dtype=torch.float64)  # like from_pretrained_no_processing
    assert raw.model.cfg.normalization_type == "LN" and not any(raw.model.processing.values())
    assert_close(raw.model.run(TOKENS)[0], ref(TOKENS), TIGHT, "unprocessed logits")
    assert raw.digest != default.digest  # a different model, a different cache key
    (folder / "qkov.json").write_text(json.dumps({"processing": {"center_unembed": False}, "note": "ignored"}))
    partial = load_checkpoint(folder, dtype=torch.float64)
    assert partial.model.processing["fold_ln"] is True and partial.model.processing["center_unembed"] is False
    tl_partial = tl_processed(ref, center_unembed=False)  # logits (not only log-probs) equal TL's
    assert_close(partial.model.run(TOKENS)[0], tl_partial(TOKENS), LOOSE, "fold_ln + centring, W_U not centred")
    assert load_checkpoint(folder, dtype=torch.float64, process=True).model.processing["center_unembed"] is True
    assert len({raw.digest, default.digest, partial.digest}) == 3
    for bad in ({"processing": {"fold_LN": False}}, {"processing": {"fold_ln": "no"}}, {"processing": 1}):
        (folder / "qkov.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="qkov.json"):
            load_checkpoint(folder)
