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

from typing import Any

import pytest
import torch
from transformer_lens import FactoredMatrix as TLFactored  # the `test` extra pins transformer-lens==3.9.0
from transformer_lens import HookedTransformer
from transformer_lens import head_detector as tl_heads

from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.copying_spectra import ov_copying_scores
from circuits_core.circuits.head_circuits import full_ov_circuit, full_qk_circuit
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
from tests.core.tl_reference import (
    ALL,
    D_VOCAB,
    LNPRE,
    LOOSE,
    MULTI,
    SHORTFORMER_LN,
    STANDARD_LN,
    TIGHT,
    TOKENS,
    assert_close,
    load_qkov,
    processed_pair,
    qkov_run,
    tl_processed,
)

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


@pytest.mark.parametrize("name", STANDARD_LN)
def test_processed_weights_equal_tl_parameter_by_parameter(world: dict[str, dict[str, Any]], name: str) -> None:
    """fold_ln, center_writing_weights, center_unembed, fold_value_biases: qkov's weights == TL's (~1e-6)."""
    model, tl_ref = processed_pair(world, name)
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
        assert_close(value, theirs[key], LOOSE, key)
    changed = [k for k in ours if k in raw and not torch.allclose(ours[k], raw[k].double(), atol=1e-4)]
    assert {"embed.W_E", "unembed.W_U", "blocks.0.attn.W_Q", "blocks.1.attn.W_O"} <= set(changed)  # not a no-op


# -- weight-based circuits -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", MULTI)
def test_composition_scores_match(world: dict[str, dict[str, Any]], name: str) -> None:
    ref = world[name]["tl"]
    ours = composition_scores(load_qkov(world, name)).raw
    for kind in "QKV":
        theirs = ref.all_composition_scores(kind)  # [L, H, L, H], 0 where layer1 >= layer2
        assert theirs.abs().max() > 0.05
        assert_close(ours[kind.lower()], theirs, TIGHT, f"{kind}-composition, unprocessed")
    model, tl_ref = processed_pair(world, name)
    processed = composition_scores(model).raw
    for kind in "QKV":
        assert_close(
            processed[kind.lower()], tl_ref.all_composition_scores(kind), LOOSE, f"{kind}-composition, processed"
        )
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
    model = load_qkov(world, name)
    ours = ov_copying_scores(model)
    assert_close(ours, _tl_copying(ref, _tl_embed_eff(ref)), TIGHT, "copying scores, LN(W_E) convention")
    plain = _tl_copying(ref, ref.W_E)  # TL's W_E @ OV @ W_U, no LayerNorm on W_E
    if ref.cfg.normalization_type is None:
        assert_close(ours, plain, TIGHT, "copying scores, no-LN model")
    else:  # the convention matters: without LN(W_E), TL's number differs
        assert (ours - plain).abs().max() > 1e-3
    model_p, tl_p = processed_pair(world, name)
    assert_close(ov_copying_scores(model_p), _tl_copying(tl_p, _tl_embed_eff(tl_p)), LOOSE, "copying scores, processed")


@pytest.mark.parametrize("name", ["attn2_sf_ln", "attn2_noln", "mlp2_std_ln", LNPRE])
def test_full_ov_and_qk_circuits_match_tl_factored_matrices(world: dict[str, dict[str, Any]], name: str) -> None:
    ref = world[name]["tl"]
    model = load_qkov(world, name)
    W_E = _tl_embed_eff(ref)
    for layer, h in [(0, 0), (model.cfg.n_layers - 1, model.cfg.n_heads - 1)]:
        tl_ov = (W_E @ ref.OV[layer, h] @ ref.W_U).AB  # [V, V] rows source token, cols output logit
        tl_qk = (W_E @ ref.QK[layer, h] @ W_E.T).AB / ref.cfg.attn_scale  # rows query token, cols key token
        assert isinstance(W_E @ ref.OV[layer, h], TLFactored)
        for ours, theirs, what in ((full_ov_circuit(model, layer, h), tl_ov, "full OV"),
                                   (full_qk_circuit(model, layer, h), tl_qk, "full QK")):  # fmt: skip
            assert_close(ours.AB, theirs, TIGHT, f"{what} L{layer}H{h}")
            values, rows, cols = ours.topk_global(8)
            top = theirs.flatten().topk(8)
            assert_close(values, top.values, TIGHT, f"{what} top entries")
            assert torch.equal(rows * D_VOCAB + cols, top.indices), what


# -- behaviour: head detectors, logit attribution -----------------------------------------------------
@pytest.mark.parametrize("name", ["attn2_sf_ln", "attn2_noln", "mlp2_std_ln", LNPRE])
def test_head_detectors_match_tl_detect_head(
    world: dict[str, dict[str, Any]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same patterns, same detection patterns; TL's `mul` score is qkov's score * eligible rows / n exactly."""
    ref = world[name]["tl"]
    model = load_qkov(world, name)
    tokens = repeated_random_tokens(D_VOCAB, seq_len=8, batch=1, seed=3, bos=0)  # [1, 17] BOS + r + r
    n = tokens.shape[1]
    # detect_head tokenises strings; give it these token ids instead (round trips through text break them).
    monkeypatch.setattr(ref, "to_tokens", lambda seq, *args, **kwargs: tokens)
    _, cache = qkov_run(model, tokens)
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
        assert_close(mine, theirs, TIGHT, f"{detector} (TL mul)")


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
        model, tl_ref = processed_pair(world, name)
        tol = LOOSE
    else:
        model, tl_ref, tol = load_qkov(world, name), world[name]["tl"], TIGHT
    cfg = model.cfg
    tokens = TOKENS[:1]
    target = int(TOKENS[0, 3])
    tl_heads_attr, components, b_U, logit = _per_head_and_component_attribution(tl_ref, model, tokens, target)
    exp = expand_logits(model, tokens[0], target, positions=-1, max_order=cfg.n_layers, by_source=False)
    assert_close(exp.value, logit.reshape(1), tol, "logit")
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
    assert_close(torch.tensor(mine, dtype=torch.float64), tl_heads_attr, tol, "per-head attribution")
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
        assert_close(torch.tensor(value, dtype=torch.float64), theirs[label].reshape(()), tol, f"component {label}")
    assert_close(torch.tensor(values[("bias:unembed",)], dtype=torch.float64), b_U, tol, "b_U (+ ln_final.b) term")
    assert_close(sum(theirs.values()) + b_U, logit, tol, "components sum to the logit")


@pytest.mark.parametrize("name", ALL)
def test_processed_model_matches_tl_processed(world: dict[str, dict[str, Any]], name: str) -> None:
    """qkov's process=True against TL's processing with the same switches (~1e-6: TL processes in float32)."""
    ref = world[name]["tl"]
    model = load_qkov(world, name, process=True)
    done = model.processing
    if name in SHORTFORMER_LN:  # TL's from_pretrained turns all three off for shortformer models; so does qkov
        assert done["fold_ln"] is False and "shortformer" in str(done["fold_ln_skipped"])
        assert done["center_writing_weights"] is False and "shortformer" in str(done["center_writing_weights_skipped"])
        assert done["center_unembed"] is False and "shortformer" in str(done["center_unembed_skipped"])
        assert_close(model.W_pos, ref.W_pos, TIGHT, "shortformer W_pos is never centred")
        # Why: TL 3.9.0's process_weights_() (unlike from_pretrained) folds ln1.w into the W_pos path and centres
        # W_pos on shortformer models, which changes the model; qkov's default processing does not.
        naive = tl_processed(ref)
        assert (naive(TOKENS).log_softmax(-1) - ref(TOKENS).log_softmax(-1)).abs().max() > 1e-2
    elif name == "attn2_noln":
        assert "center_writing_weights_skipped" in done
    same, tl_ref = processed_pair(world, name)  # == `model` except for shortformer (TL's choices there)
    assert_close(same.run(TOKENS)[0], tl_ref(TOKENS), LOOSE, "processed logits")
    for layer in range(model.cfg.n_layers):
        assert_close(qkov_run(same, TOKENS)[1][f"blocks.{layer}.attn.hook_pattern"],
               tl_ref.run_with_cache(TOKENS)[1]["pattern", layer], LOOSE, f"processed pattern L{layer}")  # fmt: skip
    # processing is exact: qkov's processed log-probs equal the unprocessed TL model's to float64 round-off
    assert_close(model.run(TOKENS)[0].log_softmax(-1), ref(TOKENS).log_softmax(-1), TIGHT, "log-probs unchanged")
