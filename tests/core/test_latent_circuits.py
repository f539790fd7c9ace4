"""The MLA circuits (circuits/latent_circuits.py) in float64 on DeepSeek-V3 and V2-Lite-shaped checkpoints that
transformers writes: the content and rotary terms, with the prompt's frozen latent scales ρ_q, ρ_kv, sum to the
model's attention scores (whose patterns equal transformers', test_deepseek_hf.py) to 1e-9; the engine's per-head
Ω_h(δ) = W_Q R(δ) W_Kᵀ is A_h + C_h R(δ) Dᵀ; OV_h equals the dense product of transformers' own weights, and the
head's output on the prompt is Σⱼ p_ij x̂ⱼ OV_h / ρ_kv(j)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from circuits_core.circuits.embedding import embed_eff_rows
from circuits_core.circuits.latent_circuits import latent_head, latent_rho, rotary_term, score_terms, term_norms
from circuits_core.circuits.rotary import omega
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import load_checkpoint
from tests.core.hf_families import TOKENS, save
from tests.core.test_deepseek_hf import deepseek_model

F64 = torch.float64
NAMES = ("v3", "v2-lite-grouped")  # a query latent (ρ_q measured) and none (ρ_q ≡ 1); interleaved rope, YaRN


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("latent_circuits")
    out = {}
    for name in NAMES:
        model = deepseek_model(name, seed=11)
        out[name] = (save(model, root / name), model)
    return out


def _wanted(name: str) -> bool:
    return name.endswith(("hook_attn_scores", "ln1.hook_normalized", "latent_norm.hook_scale", "hook_pattern",
                          "hook_result"))  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("process", [False, True])
def test_content_and_rotary_terms_sum_to_the_scores(
    world: dict[str, tuple[Path, Any]], name: str, process: bool
) -> None:
    model = load_checkpoint(world[name][0], dtype=F64, process=process).model
    tokens = TOKENS[0]
    n = tokens.shape[0]
    _, cache = model.run(tokens[None], names=_wanted)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(model.cfg.n_layers):
        x_hat = cache[f"blocks.{layer}.ln1.hook_normalized"][0]  # [n, d_model]
        rho_q, rho_kv = latent_rho(model, layer, x_hat)  # measured here, from x̂ and the weights
        kv_run = cache[f"blocks.{layer}.attn.kv_latent_norm.hook_scale"][0, :, 0]
        assert (rho_kv - kv_run).abs().max() < 1e-12  # the run's frozen ρ_kv
        if model.cfg.mla_q_rank is not None:
            assert (rho_q - cache[f"blocks.{layer}.attn.q_latent_norm.hook_scale"][0, :, 0]).abs().max() < 1e-12
        else:
            assert bool((rho_q == 1).all())
        for h in range(model.cfg.n_heads):
            content, rotary = score_terms(model, layer, h, x_hat, rho_q, rho_kv)
            scores = cache[f"blocks.{layer}.attn.hook_attn_scores"][0, h]
            assert (content + rotary - scores)[causal].abs().max() < 1e-9
            assert (rotary - scores)[causal].abs().max() > 1e-3  # neither term alone is the score
            assert (content - scores)[causal].abs().max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_the_engines_omega_is_the_content_plus_the_rotary_term(world: dict[str, tuple[Path, Any]], name: str) -> None:
    model = load_checkpoint(world[name][0], dtype=F64).model
    for layer in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            for delta in (0, 1, 5):
                total = latent_head(model, layer, h).content.AB + rotary_term(model, layer, h, delta).AB
                assert (omega(model, layer, h, [delta]).AB[0] - total).abs().max() < 1e-12


@pytest.mark.parametrize("name", NAMES)
def test_ov_through_the_latent(world: dict[str, tuple[Path, Any]], name: str) -> None:
    """OV_h against the dense product of transformers' own module weights (unprocessed load: the ln1 gain is not
    folded), and the head's output on the prompt against Σⱼ p_ij x̂ⱼ OV_h / ρ_kv(j)."""
    folder, reference = world[name]
    model = load_checkpoint(folder, dtype=F64, process=False).model
    cfg = model.cfg
    r, d_nope, d_v = cfg.mla_kv_rank or 0, cfg.mla_d_nope, cfg.mla_d_v
    _, cache = model.run(TOKENS[0][None], names=_wanted)
    for layer in range(cfg.n_layers):
        attn = reference.model.layers[layer].self_attn
        down = attn.kv_a_proj_with_mqa.weight.detach().to(F64)[:r].T * attn.kv_a_layernorm.weight.detach().to(F64)
        up = attn.kv_b_proj.weight.detach().to(F64).view(cfg.n_heads, d_nope + d_v, r)[:, d_nope:]  # [H, d_v, r]
        out = attn.o_proj.weight.detach().to(F64).T.reshape(cfg.n_heads, d_v, cfg.d_model)
        x_hat = cache[f"blocks.{layer}.ln1.hook_normalized"][0]
        _, rho_kv = latent_rho(model, layer, x_hat)
        for h in range(cfg.n_heads):
            ov = latent_head(model, layer, h).ov
            assert (ov.AB - down @ up[h].T @ out[h]).abs().max() < 1e-12
            written = cache[f"blocks.{layer}.attn.hook_pattern"][0, h] @ (x_hat @ ov.AB / rho_kv[:, None])
            assert (written - cache[f"blocks.{layer}.attn.hook_result"][0, :, h]).abs().max() < 1e-9


def test_term_norms_and_refusal(world: dict[str, tuple[Path, Any]]) -> None:
    model = load_checkpoint(world["v3"][0], dtype=F64).model
    norms = term_norms(model, 1, 2)
    cfg = model.cfg
    assert norms["content_rank_bound"] == min(cfg.mla_d_nope, cfg.mla_kv_rank or 0, cfg.mla_q_rank or 0)
    assert torch.linalg.matrix_rank(latent_head(model, 1, 2).content.AB) <= norms["content_rank_bound"]
    assert norms["content_norm"] == pytest.approx(float(torch.linalg.matrix_norm(latent_head(model, 1, 2).content.AB)))
    from circuits_core.model.config import ModelConfig
    from circuits_core.model.transformer import random_model

    dense = random_model(ModelConfig(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=8), dtype=F64)
    with pytest.raises(InvalidInputError, match="latent attention"):
        latent_head(dense, 0, 0)


@pytest.mark.parametrize("name", NAMES)
def test_path_expansions_freeze_the_latent_scales(world: dict[str, tuple[Path, Any]], name: str) -> None:
    """The logit path expansion (routing, patterns, norm scales and ρ_kv frozen; experts and the shared expert as
    sources) sums to the logit, and the QK path terms (ρ_q, ρ_kv frozen) to a layer-1 head's scores, in float64."""
    from circuits_core.prompt.paths import expand_logits
    from circuits_core.prompt.qk_paths import expand_scores

    model = load_checkpoint(world[name][0], dtype=F64).model
    tokens = TOKENS[0]
    n = tokens.shape[0]
    logit = model(tokens[None])[0]
    full = expand_logits(model, tokens, target=(4, 9), positions=None, max_order=model.cfg.n_layers)  # every path
    actual = logit[:, 4] - logit[:, 9]
    assert (full.values.sum(0) - actual).abs().max() < 1e-9 * max(1.0, float(actual.abs().max()))
    assert any(p and p[0] == "mlp:L1.shared" for p in full.paths)  # the shared expert named as a source
    _, cache = model.run(tokens[None], names={"blocks.1.attn.hook_attn_scores"})
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for h in range(model.cfg.n_heads):
        terms = expand_scores(model, tokens, (1, h), keep_terms=True).terms
        assert terms is not None
        real = cache["blocks.1.attn.hook_attn_scores"][0, h]
        assert (terms.sum((0, 1))[causal] - real[causal]).abs().max() < 1e-9


@pytest.mark.parametrize("name", NAMES)
def test_token_tables_are_the_layer0_scores(world: dict[str, tuple[Path, Any]], name: str) -> None:
    """The full QK table at offset δ ("latent-token" form: each token's own ρ_q, ρ_kv through the embedding) is the
    score layer 0 gives the query token on the key token δ back, read from a forward pass on [key, ..., query];
    its column and row readers agree; without the scales (the weight-level form) it is not."""
    from circuits_core.circuits.qk_forms import qk_form
    from circuits_core.circuits.rotary import full_qk_circuit_at, full_qk_col_at, full_qk_row_at

    model = load_checkpoint(world[name][0], dtype=F64).model
    assert qk_form(model, "token") == "latent-token" and qk_form(model, "weight") == "latent-bilinear"
    pairs = [(3, 7), (12, 12), (40, 5)]
    for h in range(model.cfg.n_heads):
        for delta in (1, 3):
            table = full_qk_circuit_at(model, 0, h, delta)
            for query, key in pairs:
                seq = torch.tensor([[key] + [0] * (delta - 1) + [query]])
                _, cache = model.run(seq, names={"blocks.0.attn.hook_attn_scores"})
                real = cache["blocks.0.attn.hook_attn_scores"][0, h, delta, 0]
                assert abs(float(table.rows([query])[0, key]) - float(real)) < 1e-10
                assert abs(float(full_qk_col_at(model, 0, h, key, delta)[query]) - float(real)) < 1e-10
                assert abs(float(full_qk_row_at(model, 0, h, query, delta)[key]) - float(real)) < 1e-10
        unscaled = omega(model, 0, h, [1]).AB[0] / model.cfg.scale
        rows = embed_eff_rows(model, [40, 5])
        exact = float(full_qk_circuit_at(model, 0, h, 1).rows([40])[0, 5])
        assert abs(float(rows[0] @ unscaled @ rows[1]) - exact) > 1e-6  # the latent scales matter


@pytest.mark.parametrize("name", NAMES)
def test_positional_kernel_is_the_score_of_the_mean_token(world: dict[str, tuple[Path, Any]], name: str) -> None:
    """f_h(δ) is the score the layer gives a query and a key both equal to μ_l, with μ_l's own latent scales: the
    content and rotary terms of score_terms on the two-row sequence [μ, μ] at δ = 1 (and at δ = 0 on one row)."""
    from circuits_core.circuits.rotary import positional_kernel

    model = load_checkpoint(world[name][0], dtype=F64).model
    means = torch.randn(model.cfg.n_layers, model.cfg.d_model, generator=torch.Generator().manual_seed(2), dtype=F64)
    kernel = positional_kernel(model, means, [0, 1])  # [L, H, 2]
    for layer in range(model.cfg.n_layers):
        x = means[layer].expand(2, -1)
        rho_q, rho_kv = latent_rho(model, layer, x)
        for h in range(model.cfg.n_heads):
            content, rotary = score_terms(model, layer, h, x, rho_q, rho_kv)
            assert abs(float(kernel[layer, h, 1] - (content + rotary)[1, 0])) < 1e-10
            assert abs(float(kernel[layer, h, 0] - (content + rotary)[0, 0])) < 1e-10


@pytest.mark.parametrize("name", NAMES)
def test_chain_terms_are_the_expansions_terms_on_mla(world: dict[str, tuple[Path, Any]], name: str) -> None:
    """chain_terms and chain_next_token_terms (each value path through 1/rho_kv at its source) equal the full
    expansion's terms of that chain, for every source, in float64."""
    from circuits_core.prompt.frozen import frozen_run
    from circuits_core.prompt.paths import expand_logits
    from circuits_core.prompt.virtual import chain_next_token_terms, chain_terms

    model = load_checkpoint(world[name][0], dtype=F64).model
    tokens = TOKENS[0]
    run = frozen_run(model, tokens)
    target = int(run.logits_at([run.n - 1])[0].argmax())
    exp = expand_logits(model, tokens, target, positions=None, max_order=2, run=run)
    for chain in ([(1, 1), (2, 2)], [(2, 1)]):  # the second read after layer 1's experts and shared expert
        names = tuple(f"L{layer}H{h}" for layer, h in chain)
        k = len(names)
        expected = {
            p[0] if len(p) > k else "embed": exp.values[i] for i, p in enumerate(exp.paths) if p[-k:] == names
            and len(p) <= k + 1 and (len(p) == k or p[0].startswith(("bias:", "mlp:")))
        }  # fmt: skip
        got = dict(chain_terms(model, run, chain, target))
        assert got.keys() == expected.keys()
        for source, values in got.items():
            assert (values - expected[source]).abs().max() < 1e-10, source
    assert "mlp:L1.shared" in got
    nxt = chain_next_token_terms(model, run, [(0, 1), (1, 3)])
    for p in (2, 7):
        term = expand_logits(model, tokens, int(tokens[p + 1]), positions=p, max_order=2, run=run, by_source=False)
        assert abs(float(nxt[p]) - float(term.term(("L0H1", "L1H3")).value[0])) < 1e-10


@pytest.mark.parametrize("name", NAMES)
def test_qk_table_prices_are_what_torch_counts(world: dict[str, tuple[Path, Any]], name: str) -> None:
    """head_circuits' FLOP prices of the QK factors, lines and tables on an MLA model (the effective weights and
    every token's latent scales included) equal torch's FlopCounterMode count of the calls the views make."""
    from torch.utils.flop_counter import FlopCounterMode

    from circuits_core.circuits import head_circuits as hc
    from circuits_core.circuits.rotary import full_qk_circuit_at, full_qk_col_at, full_qk_row_at

    def counted(call: Any) -> int:
        with FlopCounterMode(display=False) as counter:
            call()
        return int(counter.get_total_flops())

    model = load_checkpoint(world[name][0], dtype=F64).model
    ids = torch.tensor([1, 5, 7, 9, 11, 30])
    n = int(ids.numel())

    def table() -> None:  # as app/views/circuits.py reads it: the factors on the token set only
        full_qk_circuit_at(model, 1, 2, 3, tokens=ids).topk_global(n * n)

    whole = full_qk_circuit_at(model, 1, 2, 3).AB[ids][:, ids]
    torch.testing.assert_close(full_qk_circuit_at(model, 1, 2, 3, tokens=ids).AB, whole, rtol=0, atol=1e-12)

    assert counted(lambda: hc.full_qk_circuit(model, 1, 2)) == hc.full_qk_flops(model)
    assert counted(lambda: hc.full_qk_circuit(model, 1, 2, ids)) == hc.full_qk_flops(model, n)
    assert counted(lambda: full_qk_row_at(model, 1, 2, 3, 4)) == hc.line_flops(model, "qk-row-at")
    assert counted(lambda: full_qk_col_at(model, 1, 2, 3, 4)) == hc.line_flops(model, "qk-column-at")
    assert counted(lambda: hc.full_qk_col(model, 1, 2, 3)) == hc.line_flops(model, "qk-column")
    assert counted(table) == hc.circuit_flops(model, "qk", False, n)


@pytest.mark.parametrize("name", NAMES)
def test_attention_forward_price_is_what_torch_counts(world: dict[str, tuple[Path, Any]], name: str) -> None:
    """model/flops.layer_flops of an MLA layer's attention (the latents, the up-projections, scores, z, W_O), with and
    without the pattern computed, equals torch's count of LatentAttention's own forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from circuits_core.model.flops import layer_flops
    from circuits_core.model.hooks import Frozen, Recorder

    model = load_checkpoint(world[name][0], dtype=F64).model
    x = torch.randn(2, 7, model.cfg.d_model, dtype=F64, generator=torch.Generator().manual_seed(1))
    attn = model.blocks[1].attn
    _, cache = model.run(torch.zeros(2, 7, dtype=torch.long), names={"blocks.1.attn.hook_pattern"})
    for frozen in (None, Frozen(patterns={"blocks.1.attn.hook_pattern": cache["blocks.1.attn.hook_pattern"]})):
        with FlopCounterMode(display=False) as counter:
            attn(x, x, x, Recorder(None), frozen)
        assert counter.get_total_flops() == layer_flops(model.cfg, 2, 7, frozen is None, False, 1)
