"""Hugging Face GPT-2 and GPT-NeoX folders: loaded logits equal `transformers`' forward on the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.detect import detect_format
from tests.bpe import train_bpe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ATOL = 1e-4  # float32 vs transformers' float32 forward


def _scramble(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere (HF initialises LN to 1 and biases to 0, which would hide mapping bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name or ".ln_" in name else 0.3 * noise)


def _tokens(d_vocab: int, n_ctx: int) -> torch.Tensor:
    return torch.randint(0, d_vocab, (2, n_ctx), generator=torch.Generator().manual_seed(5))


def _gpt2(folder: Path, vocab_size: int = 64, bos: int | None = 63) -> torch.Tensor:
    """Save a tiny random GPT-2 with save_pretrained (safetensors); return its logits on _tokens."""
    cfg = transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=12, n_embd=16, n_layer=2, n_head=4, n_inner=24,
        bos_token_id=bos, eos_token_id=bos,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).eval()
    _scramble(model, seed=0)
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(_tokens(vocab_size, 12)).logits


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    folder = tmp_path_factory.mktemp("gpt2")
    return folder, _gpt2(folder)


def test_gpt2_safetensors_matches_transformers(gpt2_folder: tuple[Path, torch.Tensor]) -> None:
    folder, ref = gpt2_folder
    assert detect_format(folder) == "gpt2"
    loaded = load_checkpoint(folder, process=False)
    cfg = loaded.model.cfg
    assert (cfg.positional_embedding_type, cfg.act_fn, cfg.normalization_type) == ("standard", "gelu_new", "LN")
    assert cfg.bos_token_id == 63 and cfg.d_mlp == 24
    tokens = _tokens(64, 12)
    torch.testing.assert_close(loaded.model(tokens), ref, rtol=0, atol=ATOL)
    processed = load_checkpoint(folder).model  # TransformerLens defaults: log-probs unchanged
    torch.testing.assert_close(processed(tokens).log_softmax(-1), ref.log_softmax(-1), rtol=0, atol=ATOL)
    as64 = load_checkpoint(folder, dtype=torch.float64, process=False).model
    torch.testing.assert_close(as64(tokens), ref.double(), rtol=0, atol=ATOL)


def test_gpt2_pytorch_model_bin_and_hub_key_names(tmp_path: Path, gpt2_folder: tuple[Path, torch.Tensor]) -> None:
    """Original hub checkpoints: pytorch_model.bin, keys without 'transformer.', attn.bias buffers."""
    folder, ref = gpt2_folder
    sd = load_file(str(folder / "model.safetensors"))
    hub = {k.removeprefix("transformer."): v for k, v in sd.items()}
    for layer in range(2):
        hub[f"h.{layer}.attn.bias"] = torch.ones(1, 1, 12, 12).tril()
        hub[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(hub, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    loaded = load_checkpoint(tmp_path, process=False)
    torch.testing.assert_close(loaded.model(_tokens(64, 12)), ref, rtol=0, atol=ATOL)
    assert loaded.digest != load_checkpoint(folder, process=False).digest


def test_gpt2_tokenizer_from_vocab_and_merges(tmp_path: Path) -> None:
    hf = train_bpe(["the cat sat on the mat"] * 10, vocab_size=280)
    hf.model.save(str(tmp_path))  # vocab.json + merges.txt, as GPT-2 ships them
    _gpt2(tmp_path, vocab_size=hf.get_vocab_size(), bos=None)  # BOS must come from the tokenizer
    loaded = load_checkpoint(tmp_path, process=False)
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode(" the cat")
    assert ids[0] == loaded.tokenizer.bos_token_id == hf.token_to_id("<|endoftext|>")
    assert loaded.tokenizer.token_strs(ids[1:]) == [" the", " cat"]
    assert loaded.model.cfg.bos_token_id == loaded.tokenizer.bos_token_id


def _neox(folder: Path, parallel: bool, legacy_config: bool) -> torch.Tensor:
    cfg = transformers.GPTNeoXConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=12, rotary_pct=0.25, rotary_emb_base=500, use_parallel_residual=parallel,
    )  # fmt: skip
    model = transformers.GPTNeoXForCausalLM(cfg).eval()
    _scramble(model, seed=1)
    model.save_pretrained(folder)
    if legacy_config:  # Pythia's config.json as published: rotary_pct / rotary_emb_base, no rope_parameters
        data = json.loads((folder / "config.json").read_text())
        data.pop("rope_parameters")
        data.update(rotary_pct=0.25, rotary_emb_base=500)
        (folder / "config.json").write_text(json.dumps(data))
    with torch.no_grad():
        return model(_tokens(40, 12)).logits


@pytest.mark.parametrize(("parallel", "legacy_config"), [(True, False), (False, True)])
def test_gpt_neox_matches_transformers(tmp_path: Path, parallel: bool, legacy_config: bool) -> None:
    ref = _neox(tmp_path, parallel, legacy_config)
    assert detect_format(tmp_path) == "gpt_neox"
    loaded = load_checkpoint(tmp_path, process=False)
    cfg = loaded.model.cfg
    assert (cfg.positional_embedding_type, cfg.rotary_dim, cfg.rotary_base) == ("rotary", 2, 500.0)
    assert cfg.parallel_attn_mlp is parallel and cfg.act_fn == "gelu"
    tokens = _tokens(40, 12)
    torch.testing.assert_close(loaded.model(tokens), ref, rtol=0, atol=ATOL)
    processed = load_checkpoint(tmp_path).model
    assert processed.cfg.normalization_type == "LNPre"
    torch.testing.assert_close(processed(tokens).log_softmax(-1), ref.log_softmax(-1), rtol=0, atol=ATOL)


def test_hf_errors_name_file_key_and_shapes(tmp_path: Path, gpt2_folder: tuple[Path, torch.Tensor]) -> None:
    folder, _ = gpt2_folder
    sd = load_file(str(folder / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    bad = {**sd, "transformer.h.1.attn.c_attn.weight": torch.zeros(16, 47)}
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: key transformer\.h\.1\.attn\.c_attn\.weight: expected shape \[16, 48\], given "
        r"\[16, 47\]",
    ):
        load_checkpoint(tmp_path)
    save_file({k: v for k, v in sd.items() if k != "transformer.ln_f.bias"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing key transformer\.ln_f\.bias"):
        load_checkpoint(tmp_path)
    save_file({**sd, "transformer.h.9.attn.c_attn.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected key.*transformer\.h\.9"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or pytorch_model\.bin \(found: config\.json\)"):
        load_checkpoint(tmp_path)
    data = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "activation_function": "swish"}))
    with pytest.raises(CheckpointError, match="activation 'swish' is not supported"):
        load_checkpoint(tmp_path)
