"""ALiBi GGUF files against transformers: BLOOM (`bloom`: LayerNorms with biases, the embedding LayerNorm) and MPT
(`mpt`: no biases, max_alibi_bias).

A random transformers BLOOM with 6 heads (not a power of two, where BLOOM's slope rule has its extra slopes) is
written as llama.cpp's converter writes it: the fused query_key_value's per-head (head, 3, d_head) rows reordered
into q's rows, then k's, then v's, and the tied embedding copied to output.weight. A random MPT with 6 heads and
alibi_bias_max 4 (where MPT's slopes differ from BLOOM's) is written as the converter writes it: Wqkv as stored,
no output.weight (tied), attention.max_alibi_bias. qkov reading each GGUF must give transformers' logits and eager
patterns. transformers' MptModel builds its ALiBi tensor with the default alibi_bias_max 8 whatever the config says
(MosaicML's code and llama.cpp use the configured value), so the MPT reference runs transformers' own
build_mpt_alibi_tensor with the configured value.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.statedict import build_model
from tests.core.gguf_writing import write_bloom, write_mpt
from tests.core.hf_families import TOKENS, assert_runs_like, hf_model, hf_run

FIELDS = {"hidden_size": 48, "n_layer": 2, "n_head": 6, "pad_token_id": None, "eos_token_id": None,
          "bos_token_id": None}  # fmt: skip


def test_logits_and_patterns_equal_transformers(tmp_path: Path) -> None:
    model = hf_model("BloomConfig", "BloomForCausalLM", FIELDS, seed=53)
    write_bloom(model, tmp_path / "m.gguf")
    loaded = assert_runs_like(tmp_path, model)
    assert loaded.model.cfg.alibi == "bloom" and loaded.model.cfg.n_heads == 6


MPT = {"d_model": 48, "n_heads": 6, "n_layers": 2, "max_seq_len": 64, "attn_config": {"alibi_bias_max": 4}}


def mpt_model(seed: int) -> Any:
    """A random transformers MPT whose ALiBi tensor uses the configured alibi_bias_max (module docstring)."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    model = hf_model("MptConfig", "MptForCausalLM", MPT, seed=seed)
    bias_max = model.config.attn_config.alibi_bias_max
    model.transformer.build_mpt_alibi_tensor = lambda heads, n, alibi_bias_max=8, device=None: build_mpt_alibi_tensor(
        heads, n, bias_max, device
    )
    return model


def test_mpt_logits_and_patterns_equal_transformers(tmp_path: Path) -> None:
    model = mpt_model(seed=54)
    write_mpt(model, tmp_path / "m.gguf")
    loaded = assert_runs_like(tmp_path, model)
    cfg = loaded.model.cfg
    assert (cfg.alibi, cfg.alibi_bias_max, cfg.n_heads, cfg.use_bias) == ("mpt", 4.0, 6, False)
    assert [d.field for d in loaded.defaulted] == ["attn_scale"]
    ref_logits = hf_run(model, TOKENS)[0]
    bloom_slopes = dataclasses.replace(cfg, alibi="bloom")  # BLOOM's rule (max bias 8) is not this file's
    swapped = build_model(bloom_slopes, loaded.model.state_dict(), torch.float32, "x")
    assert (swapped(TOKENS) - ref_logits).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("extra", "message"),
    [({"mpt.attention.max_alibi_bias": gguf.GGUFValue(0.0, gguf.GGUFValueType.FLOAT32)}, "without ALiBi"),
     ({"mpt.attention.clamp_kqv": gguf.GGUFValue(6.0, gguf.GGUFValueType.FLOAT32)}, "clip_qkv")],
)  # fmt: skip
def test_mpt_variants_qkov_cannot_honour_are_refused_by_name(
    tmp_path: Path, extra: dict[str, gguf.GGUFValue], message: str
) -> None:
    write_mpt(mpt_model(seed=55), tmp_path / "m.gguf", extra)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)
