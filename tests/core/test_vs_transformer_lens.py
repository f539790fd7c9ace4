"""qkov against TransformerLens on checkpoints that TransformerLens itself wrote (an outside reviewer's check).

Each model is a `HookedTransformer(HookedTransformerConfig(...))` with seeded random weights (LN weights and
biases, every bias, non-trivial), saved the way a researcher does: `torch.save(model.state_dict(), "model.pth")`
or safetensors, plus `config.json` from `model.cfg.to_dict()` (dtype/device turned into strings, every other
field kept, including the ones qkov ignores). qkov loads the folder with `load_checkpoint` and TransformerLens
runs the same model in float64.

Tolerances (docs/maths.md §4.3): TransformerLens's `process_weights` casts float64 to float32 while it processes,
so processed models agree to ~1e-6 only; everything that does not go through TL's processing agrees to 1e-10.

Conventions documented here:
- OV copying score: qkov applies layer 0's ln1 to the rows of W_E ("LN(W_E)", the paper's LN appendix) when
  the model has LayerNorm; TL's `W_E @ model.OV @ W_U` does not. No-LN models are compared directly; LN models
  against TL's number computed with TL's own ln1 module applied to W_E.
- Head detectors: TL's `detect_head(..., error_measure="mul")` divides the attention on the detection pattern by
  the whole pattern's sum (= n positions); qkov averages over the eligible query rows. So TL mul ==
  qkov score * (eligible rows) / n exactly, given equal patterns -- which is what is asserted.
- Shortformer models (the paper's): like TL's `from_pretrained`, qkov applies neither fold_ln (recorded as
  `fold_ln_skipped`: W_pos is added after ln1, so folding ln1.w into W_Q/W_K would scale W_pos too) nor
  center_writing_weights nor center_unembed (exact for log-probs, but centring W_U moves the OV copying scores
  away from TL's). TL's own `process_weights_()` has no such guard: on a shortformer LN model it changes the
  log-probs (asserted below, to show the guard is needed).
- Rotary: the TL reference is built with dtype=float64 (TL's rotary tables are float32 otherwise).
- The user chooses the processing: `load_checkpoint(process=...)` or `qkov.json` next to the checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformer_lens import FactoredMatrix as TLFactored  # the `test` extra pins transformer-lens==3.9.0
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens import head_detector as tl_heads

from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.copying_spectra import ov_copying_scores
from circuits_core.circuits.head_circuits import full_ov_circuit, full_qk_circuit
from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.processing import ProcessingOptions
from circuits_core.formats.transformer_lens import TL_BUFFERS
from circuits_core.model.head_names import head_name
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.detectors import (
    duplicate_targets,
    induction_targets,
    pattern_detector_scores,
    repeated_random_tokens,
)
from circuits_core.prompt.paths import expand_logits

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")

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


def _randomise(model: HookedTransformer, seed: int) -> None:
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


def _config_json(model: HookedTransformer) -> dict[str, Any]:
    """`model.cfg.to_dict()` made JSON-serialisable as a researcher would: dtype/device -> str, the rest kept."""
    out = {}
    for key, value in model.cfg.to_dict().items():
        out[key] = str(value) if isinstance(value, torch.dtype | torch.device) else value
    assert out["dtype"].startswith("torch.float")
    return out


def _write(model: HookedTransformer, folder: Path, kind: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(_config_json(model), indent=2))
    state = model.state_dict()
    if kind == "pth":
        torch.save(state, folder / "model.pth")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def _tl_model(spec: dict[str, Any], seed: int) -> HookedTransformer:
    cfg = HookedTransformerConfig(**BASE, **spec, seed=seed)
    model = HookedTransformer(cfg)
    _randomise(model, seed)
    return model.eval()


def _tl64(model: HookedTransformer) -> HookedTransformer:
    """The same model built in float64 (not `.to(float64)`: TL computes its rotary tables at construction, in
    float32 unless cfg.dtype is float64) with the saved weights loaded; rotary tables stay the float64 ones."""
    clone = HookedTransformer(HookedTransformerConfig(**{**_config_json(model), "dtype": torch.float64}))
    state = {k: v for k, v in model.state_dict().items() if not k.endswith((".rotary_sin", ".rotary_cos"))}
    missing, unexpected = clone.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith((".rotary_sin", ".rotary_cos")) for k in missing)
    return clone.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """name -> {"tl": float64 TL model, "raw": TL state dict as saved, "pth": folder, "st": folder}."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tl_checkpoints")
    out: dict[str, dict[str, Any]] = {}
    for i, (name, spec) in enumerate(SPECS.items()):
        model = _tl_model(spec, seed=10 + i)
        out[name] = {
            "tl": _tl64(model),
            "raw": model.state_dict(),
            "pth": _write(model, root / f"{name}_pth", "pth"),
            "st": _write(model, root / f"{name}_st", "st"),
        }
    # A processed model, as `HookedTransformer.from_pretrained` would hold it (LNPre), written by a researcher.
    processed = _tl_model(SPECS["mlp2_std_ln"], seed=10 + list(SPECS).index("mlp2_std_ln"))
    processed.process_weights_()
    assert processed.cfg.normalization_type == "LNPre"
    out[LNPRE] = {
        "tl": _tl64(processed),
        "raw": processed.state_dict(),
        "pth": _write(processed, root / f"{LNPRE}_pth", "pth"),
        "st": _write(processed, root / f"{LNPRE}_st", "st"),
    }
    return out


def _load(
    world: dict[str, dict[str, Any]], name: str, process: bool | ProcessingOptions = False, kind: str = "pth"
) -> Transformer:
    return load_checkpoint(world[name][kind], dtype=torch.float64, process=process).model


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, what: str) -> None:
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert a.shape == b.shape and err <= atol * max(1.0, b.abs().max().item()), f"{what}: max error {err:.3g}"


def _qkov_run(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return model.run(tokens, names=lambda n: n.endswith(("hook_pattern", "hook_scale")))


def _tl_processed(tl_model: HookedTransformer, **flags: bool) -> HookedTransformer:
    clone = _tl64(tl_model)
    clone.load_and_process_state_dict(clone.state_dict(), **flags)
    return clone


# -- files: the loader reads what TL wrote, drops TL's buffers, ignores unknown config fields -------------
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
    assert _load(world, name).processing.get("fold_ln") is not True  # process=False applies nothing


# -- forward pass -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_unprocessed_logits_and_patterns_match(world: dict[str, dict[str, Any]], name: str) -> None:
    ref = world[name]["tl"]
    model = _load(world, name, kind="st")
    logits, cache = _qkov_run(model, TOKENS)
    tl_logits, tl_cache = ref.run_with_cache(TOKENS)
    _close(logits, tl_logits, TIGHT, "logits")
    _close(logits.log_softmax(-1), tl_logits.log_softmax(-1), TIGHT, "log-probs")
    for layer in range(model.cfg.n_layers):
        _close(cache[f"blocks.{layer}.attn.hook_pattern"], tl_cache["pattern", layer], TIGHT, f"pattern L{layer}")
        if model.cfg.normalization_type is not None:
            key = f"blocks.{layer}.ln1.hook_scale"
            _close(cache[key], tl_cache[key], TIGHT, key)


def _processed_pair(world: dict[str, dict[str, Any]], name: str) -> tuple[Transformer, HookedTransformer]:
    """qkov's processed model and TL's, with the same switches (TL's from_pretrained choices for shortformer)."""
    if "pair" not in world[name]:
        world[name]["pair"] = _make_processed_pair(world, name)
    return world[name]["pair"]


def _make_processed_pair(world: dict[str, dict[str, Any]], name: str) -> tuple[Transformer, HookedTransformer]:
    model = _load(world, name, process=True)  # for shortformer models: TL's from_pretrained switches
    flags = {
        k: bool(model.processing[k])
        for k in ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
    }
    return model, _tl_processed(world[name]["tl"], **flags)


@pytest.mark.parametrize("name", STANDARD_LN)
def test_processed_weights_equal_tl_parameter_by_parameter(world: dict[str, dict[str, Any]], name: str) -> None:
    """fold_ln, center_writing_weights, center_unembed, fold_value_biases: qkov's weights == TL's (~1e-6)."""
    model, tl_ref = _processed_pair(world, name)
    assert all(
        model.processing[k] is True
        for k in ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
    )
    assert model.cfg.normalization_type == tl_ref.cfg.normalization_type == "LNPre"
    ours = model.state_dict()
    theirs = {k: v for k, v in tl_ref.state_dict().items() if not k.endswith(TL_BUFFERS)}
    assert set(ours) == set(theirs)
    raw = world[name]["raw"]
    for key, value in ours.items():
        _close(value, theirs[key], LOOSE, key)
    changed = [k for k in ours if k in raw and not torch.allclose(ours[k], raw[k].double(), atol=1e-4)]
    assert {"embed.W_E", "unembed.W_U", "blocks.0.attn.W_Q", "blocks.1.attn.W_O"} <= set(changed)  # not a no-op


# -- weight-based circuits -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", MULTI)
def test_composition_scores_match(world: dict[str, dict[str, Any]], name: str) -> None:
    ref = world[name]["tl"]
    ours = composition_scores(_load(world, name)).raw
    for kind in "QKV":
        theirs = ref.all_composition_scores(kind)  # [L, H, L, H], 0 where layer1 >= layer2
        assert theirs.abs().max() > 0.05
        _close(ours[kind.lower()], theirs, TIGHT, f"{kind}-composition, unprocessed")
    model, tl_ref = _processed_pair(world, name)
    processed = composition_scores(model).raw
    for kind in "QKV":
        _close(processed[kind.lower()], tl_ref.all_composition_scores(kind), LOOSE, f"{kind}-composition, processed")
    if name in STANDARD_LN:  # folding LN weights and centring do change the scores (docs/maths.md §4.2)
        assert (processed["k"] - ours["k"]).abs().max() > 1e-3


def _tl_embed_eff(ref: HookedTransformer) -> torch.Tensor:
    """qkov's W_E_eff computed with TL's own modules: layer 0's ln1 applied to each row of W_E (W_E without LN)."""
    if ref.cfg.normalization_type is None:
        return ref.W_E
    return ref.blocks[0].ln1(ref.W_E[None])[0]  # [d_vocab, d_model]


def _tl_copying(ref: HookedTransformer, W_E: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(ref.cfg.n_layers, ref.cfg.n_heads, dtype=torch.float64)
    for layer in range(ref.cfg.n_layers):
        for h in range(ref.cfg.n_heads):
            eig = (W_E @ ref.OV[layer, h] @ ref.W_U).eigenvalues  # d_head eigenvalues (mdim = d_head)
            out[layer, h] = eig.sum().real / eig.abs().sum()
    return out


@pytest.mark.parametrize("name", ALL)
def test_ov_copying_scores_match(world: dict[str, dict[str, Any]], name: str) -> None:
    ref = world[name]["tl"]
    model = _load(world, name)
    ours = ov_copying_scores(model)
    _close(ours, _tl_copying(ref, _tl_embed_eff(ref)), TIGHT, "copying scores, LN(W_E) convention")
    plain = _tl_copying(ref, ref.W_E)  # TL's W_E @ OV @ W_U, no LayerNorm on W_E
    if ref.cfg.normalization_type is None:
        _close(ours, plain, TIGHT, "copying scores, no-LN model")
    else:  # the convention matters: without LN(W_E), TL's number differs
        assert (ours - plain).abs().max() > 1e-3
    model_p, tl_p = _processed_pair(world, name)
    _close(ov_copying_scores(model_p), _tl_copying(tl_p, _tl_embed_eff(tl_p)), LOOSE, "copying scores, processed")


@pytest.mark.parametrize("name", ["attn2_sf_ln", "attn2_noln", "mlp2_std_ln", LNPRE])
def test_full_ov_and_qk_circuits_match_tl_factored_matrices(world: dict[str, dict[str, Any]], name: str) -> None:
    ref = world[name]["tl"]
    model = _load(world, name)
    W_E = _tl_embed_eff(ref)
    for layer, h in [(0, 0), (model.cfg.n_layers - 1, model.cfg.n_heads - 1)]:
        tl_ov = (W_E @ ref.OV[layer, h] @ ref.W_U).AB  # [V, V] rows source token, cols output logit
        tl_qk = (W_E @ ref.QK[layer, h] @ W_E.T).AB / ref.cfg.attn_scale  # rows query token, cols key token
        assert isinstance(W_E @ ref.OV[layer, h], TLFactored)
        for ours, theirs, what in ((full_ov_circuit(model, layer, h), tl_ov, "full OV"),
                                   (full_qk_circuit(model, layer, h), tl_qk, "full QK")):  # fmt: skip
            _close(ours.AB, theirs, TIGHT, f"{what} L{layer}H{h}")
            values, rows, cols = ours.topk_global(8)
            top = theirs.flatten().topk(8)
            _close(values, top.values, TIGHT, f"{what} top entries")
            assert torch.equal(rows * D_VOCAB + cols, top.indices), what


# -- behaviour: head detectors, logit attribution -----------------------------------------------------
@pytest.mark.parametrize("name", ["attn2_sf_ln", "attn2_noln", "mlp2_std_ln", LNPRE])
def test_head_detectors_match_tl_detect_head(
    world: dict[str, dict[str, Any]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same patterns, same detection patterns; TL's `mul` score is qkov's score * eligible rows / n exactly."""
    ref = world[name]["tl"]
    model = _load(world, name)
    tokens = repeated_random_tokens(D_VOCAB, seq_len=8, batch=1, seed=3, bos=0)  # [1, 17] BOS + r + r
    n = tokens.shape[1]
    # detect_head tokenises strings; give it these token ids instead (round trips through text break them).
    monkeypatch.setattr(ref, "to_tokens", lambda seq, *args, **kwargs: tokens)
    _, cache = _qkov_run(model, tokens)
    ours = [
        pattern_detector_scores(cache[f"blocks.{layer}.attn.hook_pattern"], tokens)
        for layer in range(model.cfg.n_layers)
    ]
    tl_patterns = {
        "previous_token": tl_heads.get_previous_token_head_detection_pattern(tokens),
        "duplicate_token": tl_heads.get_duplicate_token_head_detection_pattern(tokens),
        "induction": tl_heads.get_induction_head_detection_pattern(tokens),
    }
    targets = {"previous_token": torch.eye(n, dtype=torch.bool).roll(-1, 1).tril(-1), "duplicate_token": duplicate_targets(tokens)[0],  # noqa: E501 (a table kept on one line)
               "induction": induction_targets(tokens)[0]}  # fmt: skip
    for detector, tl_name in (("previous_token", "previous_token_head"), ("duplicate_token", "duplicate_token_head"),
                              ("induction", "induction_head")):  # fmt: skip
        assert torch.equal(tl_patterns[detector] > 0, targets[detector]), f"{detector}: detection patterns differ"
        eligible = int(targets[detector].any(-1).sum())
        assert eligible > 0
        theirs = tl_heads.detect_head(ref, "ignored", tl_name, error_measure="mul")  # [L, H]
        mine = torch.stack([scores[detector] for scores in ours]) * eligible / n
        _close(mine, theirs, TIGHT, f"{detector} (TL mul)")


def _per_head_and_component_attribution(
    tl_ref: HookedTransformer, model: Transformer, tokens: torch.Tensor, target: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """TL: (per-head DLA [L*H], decompose_resid components {label: value}, b_U[target], logit) at the last position."""
    logits, cache = tl_ref.run_with_cache(tokens)
    heads = cache.apply_ln_to_stack(cache.stack_head_results(layer=-1, pos_slice=-1), layer=-1, pos_slice=-1)
    stack, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    stack = cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1)
    u = tl_ref.W_U[:, target]
    components = dict(zip(labels, stack[:, 0] @ u, strict=True))
    return heads[:, 0] @ u, components, tl_ref.b_U[target], logits[0, -1, target]


@pytest.mark.parametrize("name", ["attn2_noln", LNPRE, "attn2_std_ln"])
def test_path_expansion_matches_tl_logit_attribution(world: dict[str, dict[str, Any]], name: str) -> None:
    """Per head: the paths of qkov's expansion that end at that head == TL's stack_head_results(-1) @ W_U[:, t];
    per component: decompose_resid + apply_ln_to_stack == the matching groups of qkov's order-0 terms."""
    if name == "attn2_std_ln":  # an LN model: TL's apply_ln_to_stack needs folded LN weights, so compare processed
        model, tl_ref = _processed_pair(world, name)
        tol = LOOSE
    else:
        model, tl_ref, tol = _load(world, name), world[name]["tl"], TIGHT
    cfg = model.cfg
    tokens = TOKENS[:1]
    target = int(TOKENS[0, 3])
    tl_heads_attr, components, b_U, logit = _per_head_and_component_attribution(tl_ref, model, tokens, target)
    exp = expand_logits(model, tokens[0], target, positions=-1, max_order=cfg.n_layers, by_source=False)
    _close(exp.value, logit.reshape(1), tol, "logit")
    assert abs(float(exp.remainder[0])) < 1e-9 * max(1.0, abs(float(logit)))
    values = {path: float(exp.values[i, 0]) for i, path in enumerate(exp.paths)}
    _, run_cache = model.run(tokens, names={"ln_final.hook_scale"})
    inv_f = 1.0 / run_cache["ln_final.hook_scale"][0, -1, 0] if cfg.normalization_type is not None else 1.0
    u = model.W_U[:, target]
    mine = []
    for layer in range(cfg.n_layers):
        for h in range(cfg.n_heads):
            # b_V^h W_O^h rides in the head's result in TL; qkov moves it to the layer's bias source ("bias:L{l}")
            bv = model.blocks[layer].attn.b_V[h] @ model.blocks[layer].attn.W_O[h]
            bv = (bv - bv.mean()) * inv_f if cfg.normalization_type is not None else bv
            mine.append(sum(v for p, v in values.items() if p and p[-1] == head_name(layer, h)) + float(bv @ u))
    _close(torch.tensor(mine, dtype=torch.float64), tl_heads_attr, tol, "per-head attribution")
    # components: embed (+ pos_embed for standard positions) | attention layer l | MLP l | b_U
    grouped = {"embed": values[()]}
    for layer in range(cfg.n_layers):
        heads_l = sum(v for p, v in values.items() if p and p[-1].startswith(f"L{layer}H"))
        grouped[f"{layer}_attn_out"] = heads_l + values[(f"bias:L{layer}",)]
        if not cfg.attn_only:
            grouped[f"{layer}_mlp_out"] = values[(f"mlp:L{layer}",)]
    theirs = dict(components)
    if cfg.positional_embedding_type == "standard":
        theirs["embed"] = theirs["embed"] + theirs.pop("pos_embed")
    else:  # shortformer: TL stacks pos_embed although it is not in the residual stream (docs/maths.md §4.6)
        pos = theirs.pop("pos_embed")
        assert abs(float(sum(components.values()) + b_U - logit)) > 1e-6 and abs(float(pos)) > 1e-6
    assert set(theirs) == set(grouped)
    for label, value in grouped.items():
        _close(torch.tensor(value, dtype=torch.float64), theirs[label].reshape(()), tol, f"component {label}")
    _close(torch.tensor(values[("bias:unembed",)], dtype=torch.float64), b_U, tol, "b_U (+ ln_final.b) term")
    _close(sum(theirs.values()) + b_U, logit, tol, "components sum to the logit")


@pytest.mark.parametrize("name", ALL)
def test_processed_model_matches_tl_processed(world: dict[str, dict[str, Any]], name: str) -> None:
    """qkov's process=True against TL's processing with the same switches (~1e-6: TL processes in float32)."""
    ref = world[name]["tl"]
    model = _load(world, name, process=True)
    done = model.processing
    if name in SHORTFORMER_LN:  # TL's from_pretrained turns all three off for shortformer models; so does qkov
        assert done["fold_ln"] is False and "shortformer" in str(done["fold_ln_skipped"])
        assert done["center_writing_weights"] is False and "shortformer" in str(done["center_writing_weights_skipped"])
        assert done["center_unembed"] is False and "shortformer" in str(done["center_unembed_skipped"])
        _close(model.W_pos, ref.W_pos, TIGHT, "shortformer W_pos is never centred")
        # Why: TL 3.9.0's process_weights_() (unlike from_pretrained) folds ln1.w into the W_pos path and centres
        # W_pos on shortformer models, which changes the model; qkov's default processing does not.
        naive = _tl_processed(ref)
        assert (naive(TOKENS).log_softmax(-1) - ref(TOKENS).log_softmax(-1)).abs().max() > 1e-2
    elif name == "attn2_noln":
        assert "center_writing_weights_skipped" in done
    same, tl_ref = _processed_pair(world, name)  # == `model` except for shortformer (TL's choices there)
    _close(same.run(TOKENS)[0], tl_ref(TOKENS), LOOSE, "processed logits")
    for layer in range(model.cfg.n_layers):
        _close(_qkov_run(same, TOKENS)[1][f"blocks.{layer}.attn.hook_pattern"],
               tl_ref.run_with_cache(TOKENS)[1]["pattern", layer], LOOSE, f"processed pattern L{layer}")  # fmt: skip
    # processing is exact: qkov's processed log-probs equal the unprocessed TL model's to float64 round-off
    _close(model.run(TOKENS)[0].log_softmax(-1), ref(TOKENS).log_softmax(-1), TIGHT, "log-probs unchanged")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    """Tiny matrices: one intra-op thread is faster on shared cores (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    _close(model.run(TOKENS)[0], world["attn2_std_ln"]["tl"](TOKENS), TIGHT, "logits")


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
    _close(raw.model.run(TOKENS)[0], ref(TOKENS), TIGHT, "unprocessed logits")
    assert raw.digest != default.digest  # a different model, a different cache key
    (folder / "qkov.json").write_text(json.dumps({"processing": {"center_unembed": False}, "note": "ignored"}))
    partial = load_checkpoint(folder, dtype=torch.float64)
    assert partial.model.processing["fold_ln"] is True and partial.model.processing["center_unembed"] is False
    tl_partial = _tl_processed(ref, center_unembed=False)  # logits (not only log-probs) equal TL's
    _close(partial.model.run(TOKENS)[0], tl_partial(TOKENS), LOOSE, "fold_ln + centring, W_U not centred")
    assert load_checkpoint(folder, dtype=torch.float64, process=True).model.processing["center_unembed"] is True
    assert len({raw.digest, default.digest, partial.digest}) == 3
    for bad in ({"processing": {"fold_LN": False}}, {"processing": {"fold_ln": "no"}}, {"processing": 1}):
        (folder / "qkov.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="qkov.json"):
            load_checkpoint(folder)
