"""qkov and TransformerLens checkpoints: round trips reproduce logits; bad files fail loudly and safely."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.detect import REGISTRY, detect_format
from circuits_core.formats.processing import ProcessingOptions, process_weights
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, random_model

CFG = ModelConfig(
    n_layers=2, d_model=12, n_heads=3, d_head=4, d_vocab=29, n_ctx=10, d_mlp=16, attn_only=False,
    act_fn="gelu_new", normalization_type="LN", positional_embedding_type="standard", use_bias=True,
)  # fmt: skip
TOKENS = torch.randint(0, 29, (2, 10), generator=torch.Generator().manual_seed(3))


def _randomised(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float64) -> Transformer:
    """Random weights, with non-trivial LN weights and biases so a mis-mapped key shows in the logits."""
    model = random_model(cfg, seed=seed, dtype=dtype, std_embed=0.5)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b")) or name.rsplit(".", 1)[-1].startswith("b_"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    return model


def _tl_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The state dict TransformerLens would save, keys written out by hand (plus its buffers)."""
    cfg = model.cfg
    sd = {"embed.W_E": model.W_E, "unembed.W_U": model.W_U, "unembed.b_U": model.b_U}
    if model.W_pos is not None:
        sd["pos_embed.W_pos"] = model.W_pos
    if cfg.normalization_type == "LN":
        sd["ln_final.w"], sd["ln_final.b"] = model.ln_final.w, model.ln_final.b
    for layer, block in enumerate(model.blocks):
        p = f"blocks.{layer}"
        for x in ("Q", "K", "V", "O"):
            sd[f"{p}.attn.W_{x}"] = getattr(block.attn, f"W_{x}")
            sd[f"{p}.attn.b_{x}"] = getattr(block.attn, f"b_{x}")
        sd[f"{p}.attn.mask"] = torch.ones(cfg.n_ctx, cfg.n_ctx).tril().bool()  # TL buffers
        sd[f"{p}.attn.IGNORE"] = torch.tensor(-1e5)
        if cfg.normalization_type == "LN":
            sd[f"{p}.ln1.w"], sd[f"{p}.ln1.b"] = block.ln1.w, block.ln1.b
        if not cfg.attn_only:
            if cfg.normalization_type == "LN":
                sd[f"{p}.ln2.w"], sd[f"{p}.ln2.b"] = block.ln2.w, block.ln2.b
            for k in ("W_in", "b_in", "W_out", "b_out"):
                sd[f"{p}.mlp.{k}"] = getattr(block.mlp, k)
    return {k: v.detach().clone() for k, v in sd.items()}


def _tl_config(cfg: ModelConfig) -> dict[str, object]:
    """HookedTransformerConfig-style config.json (TL field names, including ones we ignore)."""
    return {
        "n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_ctx": cfg.n_ctx, "d_head": cfg.d_head,
        "model_name": "custom", "n_heads": cfg.n_heads, "d_mlp": cfg.d_mlp, "act_fn": cfg.act_fn,
        "d_vocab": cfg.d_vocab, "eps": cfg.eps, "use_attn_result": False, "use_attn_scale": True,
        "use_local_attn": False, "original_architecture": None, "normalization_type": cfg.normalization_type,
        "positional_embedding_type": cfg.positional_embedding_type, "attn_only": cfg.attn_only,
        "tokenizer_name": "EleutherAI/gpt-neox-20b", "dtype": "torch.float32", "rotary_dim": cfg.rotary_dim,
        "n_key_value_heads": None, "d_vocab_out": cfg.d_vocab, "gated_mlp": False, "final_rms": False,
        "default_prepend_bos": True, "parallel_attn_mlp": cfg.parallel_attn_mlp,
    }  # fmt: skip


def test_qkov_round_trip_float32_and_float64(tmp_path: Path) -> None:
    model = _randomised(CFG)
    card = {"name": "tiny", "facts": {"loss": 1.0}}
    save_checkpoint(model, tmp_path, card=card)
    assert detect_format(tmp_path) == "qkov"
    loaded = load_checkpoint(tmp_path, dtype=torch.float64, process=False)
    assert loaded.format == "qkov" and loaded.card == card and loaded.tokenizer is None
    assert loaded.model.dtype == torch.float64 and not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.cfg == CFG
    torch.testing.assert_close(loaded.model(TOKENS), model(TOKENS), rtol=0, atol=0)
    as32 = load_checkpoint(tmp_path, process=False).model
    assert as32.dtype == torch.float32
    torch.testing.assert_close(as32(TOKENS).double(), model(TOKENS), rtol=0, atol=1e-4)
    # process=True: log-probs unchanged, processing recorded and saved with the checkpoint
    processed = load_checkpoint(tmp_path, dtype=torch.float64).model
    assert processed.processing["fold_ln"] is True and processed.cfg.normalization_type == "LNPre"
    torch.testing.assert_close(processed(TOKENS).log_softmax(-1), model(TOKENS).log_softmax(-1), rtol=0, atol=1e-10)
    save_checkpoint(processed, tmp_path / "processed")
    again = load_checkpoint(tmp_path / "processed", dtype=torch.float64, process=False).model
    assert again.processing == processed.processing and again.cfg == processed.cfg
    only = load_checkpoint(tmp_path, dtype=torch.float64, process=ProcessingOptions(False, False, True, False))
    assert only.model.processing["center_unembed"] is True and only.model.processing["fold_ln"] is False


def test_bare_model_config_json_is_qkov(tmp_path: Path) -> None:
    """A folder written with config.json = ModelConfig.to_dict() (no format marker) still loads as qkov."""
    model = _randomised(CFG, dtype=torch.float32)
    save_checkpoint(model, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_dict()))
    loaded = load_checkpoint(tmp_path, process=False)
    assert loaded.format == "qkov" and loaded.model.cfg == CFG
    torch.testing.assert_close(loaded.model(TOKENS), model(TOKENS), rtol=0, atol=0)


def test_digest_is_a_content_key(tmp_path: Path) -> None:
    model = _randomised(CFG, dtype=torch.float32)
    save_checkpoint(model, tmp_path / "a")
    save_checkpoint(model, tmp_path / "b")
    with torch.no_grad():
        model.blocks[1].attn.W_O[0, 0, 0] += 1e-3
    save_checkpoint(model, tmp_path / "c")
    digests = [load_checkpoint(tmp_path / n, process=False).digest for n in "abc"]
    assert digests[0] == digests[1] != digests[2]
    assert len(digests[0]) == 64


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_transformer_lens_state_dict_reproduces_logits(tmp_path: Path, suffix: str) -> None:
    cfg = ModelConfig(**{**CFG.to_dict(), "positional_embedding_type": "shortformer"})
    model = _randomised(cfg, seed=1)
    sd = _tl_state_dict(model)
    if suffix == ".safetensors":
        save_file(sd, str(tmp_path / "weights.safetensors"))
    else:
        torch.save(sd, tmp_path / "model_final.pth")
    (tmp_path / "config.json").write_text(json.dumps(_tl_config(cfg)))
    assert detect_format(tmp_path) == "transformer_lens"
    loaded = load_checkpoint(tmp_path, dtype=torch.float64, process=False).model
    assert loaded.cfg == cfg
    torch.testing.assert_close(loaded(TOKENS), model(TOKENS), rtol=0, atol=1e-12)
    processed = load_checkpoint(tmp_path, dtype=torch.float64).model
    assert "fold_ln_skipped" in processed.processing  # shortformer + LN
    torch.testing.assert_close(processed(TOKENS).log_softmax(-1), model(TOKENS).log_softmax(-1), rtol=0, atol=1e-10)


def test_transformer_lens_attn_only_half_precision_pth(tmp_path: Path) -> None:
    """Like ARENA's attn_only_2L_half.pth: shortformer, no LN, attention only, float16 on disk."""
    cfg = ModelConfig(
        n_layers=2, d_model=12, n_heads=3, d_head=4, d_vocab=29, n_ctx=10, attn_only=True,
        normalization_type=None, positional_embedding_type="shortformer", use_bias=True,
    )  # fmt: skip
    model = _randomised(cfg, seed=2)
    torch.save({k: v.half() for k, v in _tl_state_dict(model).items()}, tmp_path / "attn_only_2L_half.pth")
    (tmp_path / "config.json").write_text(json.dumps({**_tl_config(cfg), "d_mlp": None}))
    loaded = load_checkpoint(tmp_path, process=False).model
    assert loaded.dtype == torch.float32 and loaded.cfg == cfg
    reference = process_weights(model.half().double(), False, False, False, False)  # same rounding as the file
    torch.testing.assert_close(loaded(TOKENS).double(), reference(TOKENS), rtol=0, atol=1e-4)


def test_malicious_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str, str]]:
            return (open, (str(marker), "w"))  # unpickling would create the marker file

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_tl_config(CFG)))
    torch.save({"embed.W_E": torch.zeros(2), "evil": Payload()}, folder / "model.pth")
    with pytest.raises(CheckpointError, match=r"model\.pth: refused to unpickle"):
        load_checkpoint(folder)
    assert not marker.exists()
    # The payload is real: an unsafe load would have run it.
    torch.load(folder / "model.pth", weights_only=False)
    assert marker.exists()


def test_missing_key_and_wrong_shape_name_file_key_and_shapes(tmp_path: Path) -> None:
    save_checkpoint(_randomised(CFG, dtype=torch.float32), tmp_path)
    weights = tmp_path / "model.safetensors"
    sd = load_file(str(weights))
    good = dict(sd)
    del sd["blocks.1.attn.W_K"]
    save_file(sd, str(weights))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing 1 key.*blocks\.1\.attn\.W_K \[3, 12, 4\]"):
        load_checkpoint(tmp_path)
    sd = dict(good)
    sd["blocks.0.mlp.W_in"] = torch.zeros(12, 17)
    save_file(sd, str(weights))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: key blocks\.0\.mlp\.W_in: expected shape \[12, 16\], given \[12, 17\]",
    ):
        load_checkpoint(tmp_path)
    sd = {**good, "blocks.0.attn.W_extra": torch.zeros(1)}
    save_file(sd, str(weights))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.W_extra"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        load_checkpoint(tmp_path)


def test_unknown_formats_and_unsupported_features(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        detect_format(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no config\.json \(found: weights\.bin\).*gpt_neox"):
        detect_format(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match=r"model_type='gemma'.*gpt2, gpt_neox.*found: config\.json, weights\.bin"):
        detect_format(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(CheckpointError, match=r"not a known checkpoint format \(formats: qkov, transformer_lens"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**_tl_config(CFG), "use_local_attn": True, "final_rms": True}))
    with pytest.raises(CheckpointError, match="not supported here: final_rms=True, .*use_local_attn=True"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**_tl_config(CFG), "act_fn": "solu_ln"}))
    torch.save(_tl_state_dict(_randomised(CFG)), tmp_path / "w.pt")
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(CheckpointError, match="act_fn must be one of"):
        load_checkpoint(tmp_path)
    assert set(REGISTRY) >= {"qkov", "transformer_lens", "gpt2", "gpt_neox", "llama", "mistral", "qwen2"}


def test_tokenizer_travels_with_the_checkpoint(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(CFG.d_vocab - 1)} | {"<|endoftext|>": CFG.d_vocab - 1}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    save_checkpoint(_randomised(CFG, dtype=torch.float32), tmp_path, tokenizer_json=hf.to_str())
    loaded = load_checkpoint(tmp_path)
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.encode("w3 w5") == [CFG.d_vocab - 1, 3, 5]
    assert loaded.model.cfg.bos_token_id == CFG.d_vocab - 1  # taken from the tokenizer
