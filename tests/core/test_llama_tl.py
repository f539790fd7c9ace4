"""qkov against TransformerLens 3.9.0 on Llama-family checkpoints that TransformerLens itself wrote.

Each model is a `HookedTransformer(HookedTransformerConfig(...))` with RMSNorm, rotary positions and a gated
MLP, every parameter re-drawn (RMS weights 1 + 0.3 N, every bias 0.3 N), saved as a researcher does
(`model.state_dict()` + `model.cfg.to_dict()` as config.json) and loaded with qkov's `load_checkpoint`. The
configurations cover grouped-query attention (TL's `_W_K`/`_W_V`/`_b_K`/`_b_V`), both rotary layouts
(`rotary_adjacent_pairs`), partial rotary, rope scaling (TL's `rotary_scaling_factor` = linear,
`use_NTK_by_parts_rope` = llama3), silu and gelu gates, and an RMSPre checkpoint written after TL's
`process_weights_()`. Compared: logits, attention patterns and RMS scales (unprocessed, float64), the
processed weights parameter by parameter, per-head direct logit attribution (TL's `stack_head_results` +
`apply_ln_to_stack`) against the sum of qkov's path-expansion terms ending at each head, and the weight circuits
(composition scores, full OV/QK token circuits, OV copying scores) under grouped-query attention.

Tolerances: TIGHT 1e-10 where both sides compute in float64. TransformerLens computes the llama3 (NTK-by-parts)
frequencies in float32 even for float64 models and casts weights to float32 while it processes them, so those
comparisons use LOOSE 1e-5.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from circuits_core.circuits.composition import CompositionKind, composition_scores
from circuits_core.circuits.copying_spectra import ov_copying_scores
from circuits_core.circuits.head_circuits import full_ov_circuit, full_qk_circuit
from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.transformer_lens import TL_BUFFERS
from circuits_core.model.head_names import head_name
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.frozen import attention
from circuits_core.prompt.paths import expand_logits

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")

D_VOCAB, N_CTX = 61, 24
BASE: dict[str, Any] = {
    "n_layers": 2, "d_model": 16, "n_heads": 4, "d_head": 4, "d_vocab": D_VOCAB, "n_ctx": N_CTX, "d_mlp": 24,
    "attn_only": False, "normalization_type": "RMS", "positional_embedding_type": "rotary", "gated_mlp": True,
    "act_fn": "silu", "dtype": torch.float64,
}  # fmt: skip
SPECS: dict[str, dict[str, Any]] = {
    "gqa_half": {"n_key_value_heads": 2, "rotary_dim": 4},
    "gqa1_adjacent_partial": {"n_key_value_heads": 1, "rotary_dim": 2, "rotary_adjacent_pairs": True,
                              "rotary_base": 100},
    "mha_llama3_gelu": {"rotary_dim": 4, "rotary_base": 100, "act_fn": "gelu_pytorch_tanh",
                        "use_NTK_by_parts_rope": True, "NTK_by_parts_factor": 8.0, "NTK_by_parts_low_freq_factor": 1.0,
                        "NTK_by_parts_high_freq_factor": 4.0, "NTK_original_ctx_len": 16},
    "gqa_linear_adjacent": {"n_key_value_heads": 2, "rotary_dim": 4, "rotary_adjacent_pairs": True,
                            "rotary_scaling_factor": 2.0, "act_fn": "gelu"},
}  # fmt: skip
RMSPRE = "gqa_half_rmspre"  # gqa_half after TL's process_weights_(), saved with normalization_type "RMSPre"
ALL = [*SPECS, RMSPRE]
TOKENS = torch.randint(0, D_VOCAB, (2, 17), generator=torch.Generator().manual_seed(11))
TIGHT, LOOSE = 1e-10, 1e-5


def _tol(name: str) -> float:
    return LOOSE if name == "mha_llama3_gelu" else TIGHT


def _tl_model(spec: dict[str, Any], seed: int) -> HookedTransformer:
    model = HookedTransformer(HookedTransformerConfig(**{**BASE, **spec}, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1].lstrip("_")
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if leaf == "w":
                p.copy_(1 + 0.3 * noise)
            elif leaf.startswith("b_"):
                p.copy_(0.3 * noise)
            elif leaf == "W_E":
                p.copy_(noise)
            else:  # fan-in is the second-last axis (W_Q [H, d, dh], W_in [d, d_mlp], W_U [d, V])
                p.copy_(noise * 1.5 / math.sqrt(p.shape[-2]))
    return model.eval()


def _write(model: HookedTransformer, folder: Path) -> Path:
    folder.mkdir(parents=True)
    config = {k: str(v) if isinstance(v, torch.dtype | torch.device) else v for k, v in model.cfg.to_dict().items()}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(model.state_dict(), folder / "model.pth")
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tl_llama")
    out: dict[str, dict[str, Any]] = {}
    for i, (name, spec) in enumerate(SPECS.items()):
        model = _tl_model(spec, seed=30 + i)
        out[name] = {"tl": model, "folder": _write(model, root / name)}
    processed = _tl_model(SPECS["gqa_half"], seed=30)
    processed.process_weights_()
    assert processed.cfg.normalization_type == "RMSPre"
    out[RMSPRE] = {"tl": _fresh_tables(processed), "folder": _write(processed, root / RMSPRE)}
    return out


def _fresh_tables(model: HookedTransformer) -> HookedTransformer:
    """The same weights with float64 rotary tables: TL's processing casts its rotary_sin/cos buffers to float32
    and back (2.9e-8 off), which is TL's rounding, not the model."""
    clone = HookedTransformer(HookedTransformerConfig(**model.cfg.to_dict()))
    state = {k: v for k, v in model.state_dict().items() if not k.endswith((".rotary_sin", ".rotary_cos"))}
    missing, unexpected = clone.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith((".rotary_sin", ".rotary_cos")) for k in missing)
    return clone.eval()


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, what: str) -> float:
    err = (a - b).abs().max().item()
    assert a.shape == b.shape and err <= atol * max(1.0, b.abs().max().item()), f"{what}: max error {err:.3g}"
    return err


def _load(world: dict[str, dict[str, Any]], name: str, process: bool) -> Transformer:
    return load_checkpoint(world[name]["folder"], dtype=torch.float64, process=process).model


@pytest.mark.parametrize("name", ALL)
def test_state_dict_keys_and_values_load_as_written(world: dict[str, dict[str, Any]], name: str) -> None:
    raw = {k: v for k, v in world[name]["tl"].state_dict().items() if not k.endswith(TL_BUFFERS)}
    model = _load(world, name, process=False)
    sd = model.state_dict()
    assert set(sd) == set(raw)
    assert all(torch.equal(sd[k], raw[k]) for k in sd)
    if world[name]["tl"].cfg.n_key_value_heads:
        assert "blocks.0.attn._W_K" in sd and model.W_K.shape == (2, 4, 16, 4)  # per query head, repeated
        _close(model.W_K[1], world[name]["tl"].blocks[1].attn.W_K, 0.0, "W_K per query head")


@pytest.mark.parametrize("name", ALL)
def test_unprocessed_logits_patterns_and_scales_match(world: dict[str, dict[str, Any]], name: str) -> None:
    ref, tol = world[name]["tl"], _tol(name)
    model = _load(world, name, process=False)
    logits, cache = model.run(TOKENS, names=lambda n: n.endswith(("hook_pattern", "hook_scale")))
    tl_logits, tl_cache = ref.run_with_cache(TOKENS)
    assert tl_logits.abs().max() > 1.0
    err = _close(logits, tl_logits, tol, "logits")
    print(f"{name}: max |logit - TL| = {err:.2e} (float64)")
    for layer in range(model.cfg.n_layers):
        _close(cache[f"blocks.{layer}.attn.hook_pattern"], tl_cache["pattern", layer], tol, f"pattern L{layer}")
        for ln in ("ln1", "ln2"):
            key = f"blocks.{layer}.{ln}.hook_scale"
            _close(cache[key], tl_cache[key], tol, key)


def _tl_processed(ref: HookedTransformer) -> HookedTransformer:
    clone = HookedTransformer(HookedTransformerConfig(**ref.cfg.to_dict()))
    clone.load_and_process_state_dict(
        {k: v for k, v in ref.state_dict().items() if not k.endswith((".rotary_sin", ".rotary_cos"))}
    )
    return clone.eval()


@pytest.mark.parametrize("name", list(SPECS))
def test_processed_weights_and_logits_match_tl_processing(world: dict[str, dict[str, Any]], name: str) -> None:
    """TL's RMS processing: fold the RMS weights (no centring), center_unembed, fold_value_biases; writers are
    not centred (RMSNorm does not subtract the mean). qkov's processed weights == TL's, parameter by parameter."""
    model, ref = _load(world, name, process=True), world[name]["tl"]
    tl_p = _tl_processed(ref)
    assert model.cfg.normalization_type == tl_p.cfg.normalization_type == "RMSPre"
    assert model.processing["fold_ln"] is True and "RMSNorm" in str(model.processing["center_writing_weights_skipped"])
    ours = model.state_dict()
    theirs = {k: v for k, v in tl_p.state_dict().items() if not k.endswith(TL_BUFFERS)}
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        _close(value, theirs[key].to(torch.float64), LOOSE, key)
    _close(model(TOKENS), tl_p(TOKENS).to(torch.float64), LOOSE, "processed logits")
    raw = _load(world, name, process=False)
    _close(model(TOKENS).log_softmax(-1), raw(TOKENS).log_softmax(-1), TIGHT, "processing keeps the log-probs")
    assert not torch.allclose(model.W_U, raw.W_U)  # processing did something


@pytest.mark.parametrize("name", [RMSPRE, "gqa1_adjacent_partial"])
def test_path_expansion_matches_tl_per_head_logit_attribution(world: dict[str, dict[str, Any]], name: str) -> None:
    """Per head: qkov's path terms ending at that head (+ its b_V W_O, which qkov moves to the layer's bias
    source) == TL's stack_head_results(-1) after apply_ln_to_stack, @ W_U[:, t], at the last position. TL's
    apply_ln_to_stack does not apply ln_final.w, so an RMS checkpoint is compared after both processings."""
    if name == RMSPRE:
        model, tl_ref, tol = _load(world, name, process=False), world[name]["tl"], TIGHT
    else:
        model, tl_ref, tol = _load(world, name, process=True), _tl_processed(world[name]["tl"]), LOOSE
    tokens, target = TOKENS[:1], int(TOKENS[0, 5])
    logits, cache = tl_ref.run_with_cache(tokens)
    heads = cache.apply_ln_to_stack(cache.stack_head_results(layer=-1, pos_slice=-1), layer=-1, pos_slice=-1)
    tl_attr = heads[:, 0] @ tl_ref.W_U[:, target]  # [L * H]
    exp = expand_logits(model, tokens[0], target, positions=-1, max_order=model.cfg.n_layers, by_source=False)
    _close(exp.value, logits[0, -1, target].reshape(1).to(torch.float64), tol, "logit")
    assert abs(float(exp.remainder[0])) < 1e-9 * max(1.0, float(exp.value.abs()[0]))
    _, run = model.run(tokens, names={"ln_final.hook_scale"})
    inv_f = 1.0 / run["ln_final.hook_scale"][0, -1, 0]
    u = model.W_U[:, target]
    values = {path: float(exp.values[i, 0]) for i, path in enumerate(exp.paths)}
    mine = []
    for layer in range(model.cfg.n_layers):
        attn = attention(model, layer)
        for h in range(model.cfg.n_heads):
            bv = float((attn.b_V[h] @ attn.W_O[h]) * inv_f @ u)  # RMS: no centring
            mine.append(sum(v for p, v in values.items() if p and p[-1] == head_name(layer, h)) + bv)
    assert tl_attr.abs().max() > 0.1
    _close(torch.tensor(mine, dtype=torch.float64), tl_attr.to(torch.float64), tol, "per-head attribution")


def test_rms_config_over_layernorm_weights_is_refused(world: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """A config whose norm family does not match the weights is refused naming the extra key (no silent load)."""
    folder = tmp_path / "mismatch"
    folder.mkdir()
    config = json.loads((world["gqa_half"]["folder"] / "config.json").read_text())
    state = world["gqa_half"]["tl"].state_dict()
    state["blocks.0.ln1.b"] = torch.zeros(16, dtype=torch.float64)
    torch.save(state, folder / "model.pth")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.ln1\.b"):
        load_checkpoint(folder, process=False)


@pytest.mark.parametrize("name", ["gqa_half", "gqa1_adjacent_partial", RMSPRE])
def test_weight_circuits_match_tl_under_gqa(world: dict[str, dict[str, Any]], name: str) -> None:
    """Composition scores (Q, K, V), full OV / QK token circuits and OV copying scores use TL's per-query-head
    W_K / W_V (repeated over each group). W_E is layer 0's ln1 (RMS) applied to the rows of W_E, computed with
    TL's own module (qkov's LN(W_E) convention, as in test_vs_transformer_lens)."""
    ref = world[name]["tl"]
    model = _load(world, name, process=False)
    ours = composition_scores(model).raw
    kinds: tuple[tuple[str, CompositionKind], ...] = (("Q", "q"), ("K", "k"), ("V", "v"))
    for kind, key in kinds:
        theirs = ref.all_composition_scores(kind)
        assert theirs.abs().max() > 0.05
        _close(ours[key], theirs, TIGHT, f"{kind}-composition")
    W_E = ref.blocks[0].ln1(ref.W_E[None])[0]  # [d_vocab, d_model]
    copying = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64)
    for layer in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            tl_ov = W_E @ ref.OV[layer, h] @ ref.W_U
            eig = tl_ov.eigenvalues
            copying[layer, h] = eig.sum().real / eig.abs().sum()
            _close(full_ov_circuit(model, layer, h).AB, tl_ov.AB, TIGHT, f"full OV L{layer}H{h}")
            tl_qk = (W_E @ ref.QK[layer, h] @ W_E.T).AB / ref.cfg.attn_scale
            _close(full_qk_circuit(model, layer, h).AB, tl_qk, TIGHT, f"full QK L{layer}H{h}")
    _close(ov_copying_scores(model), copying, TIGHT, "OV copying scores")
