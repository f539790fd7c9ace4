"""TransformerLens checkpoints as a researcher writes them, for the comparison tests (test_vs_transformer_lens.py,
test_tl_checkpoint_loading.py): seeded random HookedTransformers of each kind qkov reads (SPECS), saved with
`torch.save(model.state_dict())` or safetensors beside `config.json` from `model.cfg.to_dict()`, their float64
twins as the reference, and the comparisons the tests make."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformer_lens import HookedTransformer, HookedTransformerConfig

from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.processing import ProcessingOptions
from circuits_core.model.transformer import Transformer

D_VOCAB, N_CTX = 61, 24


BASE: dict[str, Any] = {"d_model": 16, "n_heads": 2, "d_head": 8, "d_vocab": D_VOCAB, "n_ctx": N_CTX}


SPECS: dict[str, dict[str, Any]] = {
    # Neel Nanda's attn-only models: LN + shortformer positions
    "attn1_sf_ln": {"n_layers": 1, "attn_only": True, "normalization_type": "LN", "positional_embedding_type": "shortformer"},  # noqa: E501 (a table kept on one line)
    "attn2_sf_ln": {"n_layers": 2, "attn_only": True, "normalization_type": "LN", "positional_embedding_type": "shortformer"},  # noqa: E501 (a table kept on one line)
    "attn3_sf_ln": {"n_layers": 3, "attn_only": True, "normalization_type": "LN", "positional_embedding_type": "shortformer"},  # noqa: E501 (a table kept on one line)
    "attn2_std_ln": {"n_layers": 2, "attn_only": True, "normalization_type": "LN", "positional_embedding_type": "standard"},  # noqa: E501 (a table kept on one line)
    # ARENA's 2L model: no LN, shortformer (written in float64: config.json says "torch.float64")
    "attn2_noln": {"n_layers": 2, "attn_only": True, "normalization_type": None, "positional_embedding_type": "shortformer",  # noqa: E501 (a table kept on one line)
                   "dtype": torch.float64},
    "attn2_rot_ln": {"n_layers": 2, "attn_only": True, "normalization_type": "LN", "positional_embedding_type": "rotary",  # noqa: E501 (a table kept on one line)
                     "rotary_dim": 4},
    "mlp2_std_ln": {"n_layers": 2, "attn_only": False, "d_mlp": 32, "act_fn": "gelu_new", "normalization_type": "LN",
                    "positional_embedding_type": "standard"},
}  # fmt: skip


LNPRE = "mlp2_lnpre"  # mlp2_std_ln after TL's process_weights_(), saved with normalization_type "LNPre"


ALL = [*SPECS, LNPRE]


MULTI = [name for name in ALL if SPECS.get(name, {"n_layers": 2})["n_layers"] > 1]


STANDARD_LN = ["attn2_std_ln", "attn2_rot_ln", "mlp2_std_ln"]  # LN, positions not added after ln1


SHORTFORMER_LN = ["attn1_sf_ln", "attn2_sf_ln", "attn3_sf_ln"]


TOKENS = torch.randint(0, D_VOCAB, (2, 17), generator=torch.Generator().manual_seed(7))


# LOOSE: TL rounds every weight to float32 while processing (~6e-8 relative), amplified through the layers
TIGHT, LOOSE = 1e-10, 1e-5


def randomise(model: HookedTransformer, seed: int) -> None:
    """Every parameter random: LN w ~ 1 + 0.3 N, biases 0.3 N, embeddings N(0, 1), matrices N(0, 1.5^2 / fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if leaf == "w":
                value = 1 + 0.3 * noise
            elif leaf == "b" or leaf.startswith("b_"):
                value = 0.3 * noise
            elif leaf in ("W_E", "W_pos"):
                value = noise
            else:  # W_Q/W_K/W_V [H, d, dh], W_O [H, dh, d], W_in, W_out, W_U: fan-in is the second-last axis
                value = noise * 1.5 / math.sqrt(p.shape[-2])
            p.copy_(value.to(p.dtype))


def config_json(model: HookedTransformer) -> dict[str, Any]:
    """`model.cfg.to_dict()` made JSON-serialisable as a researcher would: dtype/device -> str, the rest kept."""
    out = {}
    for key, value in model.cfg.to_dict().items():
        out[key] = str(value) if isinstance(value, torch.dtype | torch.device) else value
    assert out["dtype"].startswith("torch.float")
    return out


def write_checkpoint(model: HookedTransformer, folder: Path, kind: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config_json(model), indent=2))
    state = model.state_dict()
    if kind == "pth":
        torch.save(state, folder / "model.pth")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def tl_model(spec: dict[str, Any], seed: int) -> HookedTransformer:
    cfg = HookedTransformerConfig(**BASE, **spec, seed=seed)
    model = HookedTransformer(cfg)
    randomise(model, seed)
    return model.eval()


def tl64(model: HookedTransformer) -> HookedTransformer:
    """The same model built in float64 (not `.to(float64)`: TL computes its rotary tables at construction, in
    float32 unless cfg.dtype is float64) with the saved weights loaded; rotary tables stay the float64 ones."""
    clone = HookedTransformer(HookedTransformerConfig(**{**config_json(model), "dtype": torch.float64}))
    state = {k: v for k, v in model.state_dict().items() if not k.endswith((".rotary_sin", ".rotary_cos"))}
    missing, unexpected = clone.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith((".rotary_sin", ".rotary_cos")) for k in missing)
    return clone.eval().requires_grad_(False)


def build_world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """name -> {"tl": float64 TL model, "raw": TL state dict as saved, "pth": folder, "st": folder}."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tl_checkpoints")
    out: dict[str, dict[str, Any]] = {}
    for i, (name, spec) in enumerate(SPECS.items()):
        model = tl_model(spec, seed=10 + i)
        out[name] = {
            "tl": tl64(model),
            "raw": model.state_dict(),
            "pth": write_checkpoint(model, root / f"{name}_pth", "pth"),
            "st": write_checkpoint(model, root / f"{name}_st", "st"),
        }
    # A processed model, as `HookedTransformer.from_pretrained` would hold it (LNPre), written by a researcher.
    processed = tl_model(SPECS["mlp2_std_ln"], seed=10 + list(SPECS).index("mlp2_std_ln"))
    processed.process_weights_()
    assert processed.cfg.normalization_type == "LNPre"
    out[LNPRE] = {
        "tl": tl64(processed),
        "raw": processed.state_dict(),
        "pth": write_checkpoint(processed, root / f"{LNPRE}_pth", "pth"),
        "st": write_checkpoint(processed, root / f"{LNPRE}_st", "st"),
    }
    return out


def load_qkov(
    world: dict[str, dict[str, Any]], name: str, process: bool | ProcessingOptions = False, kind: str = "pth"
) -> Transformer:
    return load_checkpoint(world[name][kind], dtype=torch.float64, process=process).model


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float, what: str) -> None:
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert a.shape == b.shape and err <= atol * max(1.0, b.abs().max().item()), f"{what}: max error {err:.3g}"


def qkov_run(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return model.run(tokens, names=lambda n: n.endswith(("hook_pattern", "hook_scale")))


def tl_processed(tl_model: HookedTransformer, **flags: bool) -> HookedTransformer:
    clone = tl64(tl_model)
    clone.load_and_process_state_dict(clone.state_dict(), **flags)
    return clone


def processed_pair(world: dict[str, dict[str, Any]], name: str) -> tuple[Transformer, HookedTransformer]:
    """qkov's processed model and TL's, with the same switches (TL's from_pretrained choices for shortformer)."""
    if "pair" not in world[name]:
        world[name]["pair"] = _make_processed_pair(world, name)
    return world[name]["pair"]


def _make_processed_pair(world: dict[str, dict[str, Any]], name: str) -> tuple[Transformer, HookedTransformer]:
    model = load_qkov(world, name, process=True)  # for shortformer models: TL's from_pretrained switches
    flags = {
        k: bool(model.processing[k])
        for k in ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
    }
    return model, tl_processed(world[name]["tl"], **flags)


def one_torch_thread() -> Iterator[None]:
    """Tiny matrices: one intra-op thread is faster on shared cores (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
