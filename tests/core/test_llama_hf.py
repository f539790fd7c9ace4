"""Llama, Mistral and Qwen2 checkpoints that transformers itself saves, against transformers' own forward pass.

Each tiny model is built by transformers (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) with every
parameter re-drawn at a scale that makes the logits O(1-10) (RMS weights 1 + 0.3 N, biases 0.3 N, matrices
N(0, 1.5^2 / fan_in)), saved with `save_pretrained` (sharded with an index for one of them, bfloat16 for
another) and loaded with qkov's `load_checkpoint`. Covered: grouped-query attention, head_dim != d_model /
n_heads, attention biases (Llama attention_bias, Qwen2's q/k/v), tied and untied embeddings, each rope
scaling (default, linear, llama3, yarn with its attention factor), Mistral's sliding window. Each knob is also shown
to matter (changing it in
qkov's config changes the logits), so agreement is not an accident of a weak setting.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.detect import detect_format
from circuits_core.formats.statedict import build_model
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.frozen import attention
from tests.bpe import train_bpe

VOCAB, N = 61, 14
BASE = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "max_position_embeddings": 32, "rms_norm_eps": 1e-5}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa_default_untied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2,
                                           "tie_word_embeddings": False,
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}),
    "llama_bias_linear_tied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 4, "attention_bias": True,
                                         "tie_word_embeddings": True,
                                         "rope_parameters": {"rope_type": "linear", "rope_theta": 100.0, "factor": 3.0}}),  # noqa: E501 (a table kept on one line)
    "llama_gqa_llama3_headdim": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 6,
                                           "tie_word_embeddings": False, "rope_parameters": LLAMA3}),
    "mistral_gqa_window": ("mistral", {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 5,
                                       "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default",
                                                                                         "rope_theta": 50.0}}),
    "llama_yarn_mscale": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
                                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 8, "beta_fast": 8.0,
                                                        "beta_slow": 1.0}}),
    "qwen2_gqa_bias_tied": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}),
}  # fmt: skip
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}  # fmt: skip
TOKENS = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(3))


def _randomise(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # nn.Linear [d_out, d_in]
                p.copy_(noise * 1.5 / math.sqrt(p.shape[-1]))


def _hf_model(kind: str, extra: dict[str, Any], seed: int) -> Any:
    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[kind])
    model = model_cls(config_cls(**{**BASE, **extra})).eval()
    _randomise(model, seed)
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("llama_hf")
    out = {}
    for i, (name, (kind, extra)) in enumerate(CASES.items()):
        model = _hf_model(kind, extra, seed=20 + i)
        shard = "4KB" if name == "llama_gqa_default_untied" else "50GB"  # one checkpoint sharded with its index
        model.save_pretrained(root / name, max_shard_size=shard)
        out[name] = (root / name, model)
    return out


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers_float32(world: dict[str, tuple[Path, Any]], name: str) -> None:
    folder, hf = world[name]
    kind, extra = CASES[name]
    assert detect_format(folder) == kind
    loaded = load_checkpoint(folder, dtype=torch.float32, process=False)
    cfg = loaded.model.cfg
    assert cfg.normalization_type == "RMS" and cfg.gated_mlp and cfg.act_fn == "silu"
    assert cfg.n_kv_heads == extra["num_key_value_heads"]
    assert cfg.rope_type == extra["rope_parameters"]["rope_type"]
    ref = _logits(hf, TOKENS)
    assert ref.abs().max() > 1.0  # logits large enough for 1e-4 to be a real bound
    err = (loaded.model(TOKENS) - ref).abs().max().item()
    print(f"{name}: max |logit - transformers| = {err:.2e} (float32)")
    assert err <= 1e-4
    processed = load_checkpoint(folder, dtype=torch.float32, process=True).model
    assert processed.processing["fold_ln"] is True and processed.cfg.normalization_type == "RMSPre"
    err_p = (processed(TOKENS).log_softmax(-1) - ref.log_softmax(-1)).abs().max().item()
    print(f"{name}: processed max |log-prob - transformers| = {err_p:.2e} (float32)")
    assert err_p <= 1e-4


def _variant(model: Transformer, **changes: Any) -> Transformer:
    """The same weights under a changed config (to show that a knob matters)."""
    cfg = dataclasses.replace(model.cfg, **changes)
    return build_model(cfg, model.state_dict(), dtype=model.dtype, origin="variant")


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("llama_gqa_default_untied", {"rotary_adjacent_pairs": True}),  # the layout trap
        ("llama_bias_linear_tied", {"rope_type": "default", "rope_factor": 1.0}),
        ("llama_gqa_llama3_headdim", {"rope_type": "linear"}),  # llama3 is not plain linear division
        ("llama_gqa_llama3_headdim", {"rope_type": "default", "rope_factor": 1.0}),
        ("qwen2_gqa_bias_tied", {"rotary_base": 10000.0}),
        ("mistral_gqa_window", {"window_size": None}),  # the window is shorter than the prompt: it masks
        ("llama_yarn_mscale", {"attn_scale": None}),  # YaRN's attention factor, squared, in the score scale
        ("llama_yarn_mscale", {"rope_type": "linear"}),  # the ramp keeps the fast pairs unscaled
    ],
)
def test_each_rotary_knob_matters(world: dict[str, tuple[Path, Any]], name: str, changes: dict[str, Any]) -> None:
    model = load_checkpoint(world[name][0], dtype=torch.float32, process=False).model
    diff = (_variant(model, **changes)(TOKENS) - _logits(world[name][1], TOKENS)).abs().max().item()
    assert diff > 1e-2, f"{changes} left the logits within {diff:.2e} of transformers: the test would not see it"


def test_processed_log_probs_equal_unprocessed_float64(world: dict[str, tuple[Path, Any]]) -> None:
    for name in CASES:
        raw = load_checkpoint(world[name][0], dtype=torch.float64, process=False).model
        processed = load_checkpoint(world[name][0], dtype=torch.float64, process=True).model
        assert (
            processed.processing["center_unembed"] is True and "center_writing_weights_skipped" in processed.processing
        )
        assert not torch.equal(processed.W_U, raw.W_U)  # processing did change the weights
        err = (processed(TOKENS).log_softmax(-1) - raw(TOKENS).log_softmax(-1)).abs().max().item()
        assert err <= 1e-12, f"{name}: {err:.2e}"


def test_checkpoint_layouts(world: dict[str, tuple[Path, Any]]) -> None:
    sharded = world["llama_gqa_default_untied"][0]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    tied = load_checkpoint(world["qwen2_gqa_bias_tied"][0], dtype=torch.float64, process=False).model
    assert torch.equal(tied.W_U, tied.W_E.T)
    attn = attention(tied, 0)
    assert tied.cfg.use_bias and attn.b_O.abs().max() == 0 and attn.b_Q.abs().max() > 0  # Qwen2: q/k/v biases only
    assert attn.grouped("b_K").shape == (2, 4)
    mistral = load_checkpoint(world["mistral_gqa_window"][0], process=False).model
    assert mistral.cfg.window_size == 5 and mistral.cfg.attn_types is None  # every layer slides, shorter than N


def test_bfloat16_checkpoint_converts_per_tensor(tmp_path: Path) -> None:
    hf = _hf_model("llama", CASES["llama_gqa_default_untied"][1], seed=5)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # bf16-representable weights, held in float32
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # (the copy's rotary buffer is bf16)
    loaded = load_checkpoint(tmp_path / "bf16", dtype=torch.float32, process=False).model
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded.W_E, hf.model.embed_tokens.weight)  # bf16 -> float32 is exact
    assert (loaded(TOKENS) - _logits(hf, TOKENS)).abs().max() <= 1e-4


def test_tokenizer_json_is_read(tmp_path: Path) -> None:
    folder, vocab = tmp_path / "with_tokenizer", 300  # a byte-level BPE has at least 257 tokens
    hf = _hf_model("qwen2", {**CASES["qwen2_gqa_bias_tied"][1], "vocab_size": vocab}, seed=9)
    hf.save_pretrained(folder)
    train_bpe(["a small text for a tiny tokenizer"] * 4, vocab_size=vocab).save(str(folder / "tokenizer.json"))
    loaded = load_checkpoint(folder, process=False)
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size <= vocab
    ids = torch.tensor([loaded.tokenizer.encode("a small text")])
    assert (loaded.model(ids) - _logits(hf, ids)).abs().max() <= 1e-4


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 100.0, "factor": 2.0}}, "'longrope'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 100.0, "factor": 2.0}}, "'dynamic'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 100.0}}, "factor"),
    ],
)
def test_unsupported_configs_are_refused_by_name(
    tmp_path: Path, world: dict[str, tuple[Path, Any]], edit: dict[str, Any], message: str
) -> None:
    folder = tmp_path / "edited"
    world["llama_gqa_default_untied"][1].save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder)


def test_damaged_safetensors_are_refused(tmp_path: Path, world: dict[str, tuple[Path, Any]]) -> None:
    """qkov maps the shards itself (to release pages per tensor), so it checks what safe_open would."""
    source = world["qwen2_gqa_bias_tied"][0]
    for damage, message in (("truncate", "do not hold"), ("header", "not a readable safetensors"),
                            ("int", "not a float type"), ("nested", "nested too deeply")):  # fmt: skip
        folder = tmp_path / damage
        folder.mkdir()
        for item in source.iterdir():
            (folder / item.name).write_bytes(item.read_bytes())
        weights = folder / "model.safetensors"
        data = weights.read_bytes()
        if damage == "truncate":
            weights.write_bytes(data[: len(data) // 2])
        elif damage == "header":
            weights.write_bytes((10**12).to_bytes(8, "little") + data[8:])
        elif damage == "nested":
            header = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            weights.write_bytes(len(header).to_bytes(8, "little") + header)
        else:
            state = load_file(str(weights))
            state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
            save_file(state, str(weights))
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(folder)


@pytest.mark.parametrize("name", ["llama_gqa_llama3_headdim", "llama_bias_linear_tied"])
def test_transformers_4_config_layout(tmp_path: Path, world: dict[str, tuple[Path, Any]], name: str) -> None:
    """Hub configs written by transformers 4.x (e.g. Llama-3.2-1B) carry `rope_scaling` (`type` or `rope_type`) and
    a top-level `rope_theta` instead of `rope_parameters`: the same model loads."""
    source, hf = world[name]
    folder = tmp_path / "v4"
    folder.mkdir()
    for item in source.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((source / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = (
        {"type": rope.pop("rope_type"), **rope} if "linear" in name else {**rope, "rope_type": "llama3"}
    )
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_checkpoint(folder, dtype=torch.float32, process=False).model
    assert (loaded(TOKENS) - _logits(hf, TOKENS)).abs().max() <= 1e-4


def test_priced_from_config_before_any_tensor_is_read(tmp_path: Path) -> None:
    """A bf16 checkpoint loaded as float32 costs twice its files: refused by `max_bytes` from config.json alone
    (the damaged shard shows that no tensor was read first)."""
    hf = _hf_model("llama", CASES["llama_gqa_default_untied"][1], seed=6).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    weights = tmp_path / "bf16" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size - 64])  # truncated: reading it would fail differently
    with pytest.raises(CheckpointError, match="config.json describes a model of"):
        load_checkpoint(tmp_path / "bf16", dtype=torch.float32, max_bytes=int(1.5 * size))
    with pytest.raises(CheckpointError, match="do not hold"):  # within the price: the damage is found
        load_checkpoint(tmp_path / "bf16", dtype=torch.float32, max_bytes=4 * size)


def test_the_digest_covers_config_and_every_shard(tmp_path: Path, world: dict[str, tuple[Path, Any]]) -> None:
    """The sharded checkpoint's cache key (hashed while the tensors are read): sha256 over name + NUL + bytes of
    config.json, each shard the index names and the answer files present, in name order, written out here; one
    byte changed in the last shard changes it."""
    import hashlib
    import shutil

    from circuits_core.formats.checkpoint import ANSWER_FILES

    folder = tmp_path / "sharded"
    shutil.copytree(world["llama_gqa_default_untied"][0], folder)
    shards = sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))
    named = ["config.json", *shards, *(n for n in ANSWER_FILES if (folder / n).is_file())]
    expected = hashlib.sha256()
    for name in sorted(named):
        expected.update(name.encode() + b"\0" + (folder / name).read_bytes())
    first = load_checkpoint(folder).digest  # default processing: no switches folded into the key
    assert first == expected.hexdigest()
    last = folder / shards[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 1  # a tensor byte (the data follow the header)
    last.write_bytes(bytes(data))
    assert load_checkpoint(folder).digest not in (first, "")
