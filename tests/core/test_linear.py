"""linear.affine: oneDNN's float32 product (bias and activation in its epilogue) against float64 addmm, which path
each case takes, and the model's forward pass through it against the same weights in float64 (MKL's addmm)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from circuits_core.circuits import copying_spectra, embedding
from circuits_core.model import linear
from circuits_core.model.config import ModelConfig
from circuits_core.model.linear import affine
from circuits_core.model.transformer import random_model
from circuits_core.schedule import shared_chunks

needs_onednn = pytest.mark.skipif(linear._ONEDNN_LINEAR is None, reason="this torch has no oneDNN linear")
ACTS = [None, "relu", "gelu", "gelu_new", "silu"]
TORCH_ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


@pytest.fixture
def onednn_calls(monkeypatch):
    """Counts the products oneDNN computes."""
    calls = []
    real = linear._ONEDNN_LINEAR

    def counted(*args):
        calls.append((tuple(args[1].shape), args[3]))  # (W.t() [n_out, n_in], epilogue)
        return real(*args)

    monkeypatch.setattr(linear, "_ONEDNN_LINEAR", counted)
    return calls


def _layout(shape: tuple[int, int], kind: str, gen: torch.Generator) -> torch.Tensor:
    """A float32 [r, c] tensor stored contiguous, transposed, as a slice of wider rows or of a taller transposed one."""
    r, c = shape
    if kind == "contiguous":
        return torch.randn(r, c, generator=gen)
    if kind == "transposed":
        return torch.randn(c, r, generator=gen).t()
    if kind == "row-slice":
        return torch.randn(r, c + 7, generator=gen)[:, :c]
    return torch.randn(c, r + 5, generator=gen)[:, :r].t()  # "transposed-slice"


def _reference(x, W, b, act):
    ref = x.double() @ W.double() + (0 if b is None else b.double())
    return ref if act is None else TORCH_ACTS[act](ref)


@needs_onednn
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize(("rows", "n_in", "n_out"), [(300, 256, 384), (5, 7, 3)])
def test_affine_equals_float64_addmm_for_every_layout(act, rows, n_in, n_out, onednn_calls):
    """Every layout of x and W, with and without bias: within float32 rounding of the float64 product (max error
    relative to the output's scale), whichever library computes it; the big float32 products go through oneDNN
    (except a W made of slices of wider rows, left to MKL), the small ones and SiLU's product do not."""
    gen = torch.Generator().manual_seed(rows + n_out)
    kinds = ["contiguous", "transposed", "row-slice", "transposed-slice"]
    for x_kind, W_kind, bias in itertools.product(kinds, kinds, (False, True)):
        x = _layout((rows, n_in), x_kind, gen)
        W = _layout((n_in, n_out), W_kind, gen) / n_in**0.5
        b = torch.randn(n_out, generator=gen) if bias else None
        before = len(onednn_calls)
        got = affine(x[None], W, b, act)  # [1, rows, n_out]: leading dimensions kept
        ref = _reference(x, W, b, act)
        assert got.shape == (1, rows, n_out) and got.dtype == torch.float32
        assert (got[0].double() - ref).abs().max() <= 2e-6 * ref.abs().max(), (x_kind, W_kind, bias)
        big = rows * n_in * n_out >= linear.ONEDNN_MIN_MACS
        dense_W = W.is_contiguous() or W.t().is_contiguous()
        want = big and dense_W and x.stride(-1) == 1 and act != "silu"
        assert (len(onednn_calls) > before) == want, (x_kind, W_kind, act)


@needs_onednn
@pytest.mark.parametrize("grad_of", ["W", "x"])
def test_float64_half_and_autograd_stay_with_addmm(grad_of, onednn_calls):
    """float64 and half-precision operands, and float32 ones that autograd tracks (the weight's or only the input's
    gradient), take torch.addmm; the gradient through the activation (not applied in place there) equals the float64
    one."""
    gen = torch.Generator().manual_seed(1)
    x, W, b = (
        torch.randn(300, 256, generator=gen),
        torch.randn(256, 384, generator=gen) / 16,
        torch.randn(384, generator=gen),
    )
    affine(x.double(), W.double(), b.double(), "gelu_new")
    half = affine(x.bfloat16(), W.bfloat16(), b.bfloat16(), "gelu_new")
    assert half.dtype == torch.bfloat16 and onednn_calls == []
    leaf32, leaf64 = (W.clone(), W.double()) if grad_of == "W" else (x.clone(), x.double())
    leaf32.requires_grad_(True), leaf64.requires_grad_(True)
    args32, args64 = ((x, leaf32), (x.double(), leaf64)) if grad_of == "W" else ((leaf32, W), (leaf64, W.double()))
    affine(*args32, b, "gelu_new").sum().backward()
    F.gelu(args64[0] @ args64[1] + b.double(), approximate="tanh").sum().backward()
    assert onednn_calls == []
    assert leaf32.grad is not None and leaf64.grad is not None
    assert (leaf32.grad.double() - leaf64.grad).abs().max() <= 1e-5 * leaf64.grad.abs().max()


def _model(act_fn: str, dtype: torch.dtype, gated: bool = False):
    """d_model 256, 4 heads of 64, d_mlp 1024: on 4 x 64 tokens every product of the forward pass reaches
    ONEDNN_MIN_MACS (K and V of 2 key/value heads exactly). Gated: a Llama-shaped layer (RMS norms, rotary positions,
    2 key/value heads, no biases)."""
    llama = dict(normalization_type="RMS", positional_embedding_type="rotary", n_key_value_heads=2, use_bias=False)
    gpt2 = dict(normalization_type="LN", positional_embedding_type="standard", use_bias=True)
    cfg = ModelConfig(
        n_layers=2,
        d_model=256,
        n_heads=4,
        d_head=64,
        d_vocab=600,
        n_ctx=64,
        d_mlp=1024,
        act_fn=act_fn,
        attn_only=False,
        gated_mlp=gated,
        **(llama if gated else gpt2),
    )
    model = random_model(cfg, seed=3, std_embed=0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("b"):
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.to(dtype)


@needs_onednn
@pytest.mark.parametrize(("act_fn", "gated"), [("gelu_new", False), ("gelu", False), ("relu", False), ("silu", True)])
def test_the_float32_forward_through_onednn_equals_the_float64_forward(act_fn, gated, onednn_calls):
    """A float32 model's logits and hooks, every product through oneDNN (q, k, v, W_O, the MLP with its activation
    in the product's epilogue, W_U: counted by weight shape), equal the same weights' float64 run (MKL addmm) to
    float32 rounding; asking for hook_pre keeps the pre-activation (the activation is then not applied over it) and
    hook_post is act(hook_pre)."""
    model32 = _model(act_fn, torch.float32, gated)
    model64 = _model(act_fn, torch.float64, gated)
    tokens = torch.randint(0, 600, (4, 64), generator=torch.Generator().manual_seed(0))
    hooks = [
        "blocks.1.attn.hook_q",
        "blocks.1.attn.hook_v",
        "blocks.1.hook_attn_out",
        "blocks.0.mlp.hook_pre",
        "blocks.0.mlp.hook_post",
        "blocks.1.hook_mlp_out",
    ]
    epilogue = {"gelu_new": "gelu", "gelu": "gelu", "relu": "relu"}.get(act_fn)
    kv = 2 * 64 if gated else 256  # key/value heads x d_head
    per_layer = [
        ((256, 256), "none"),
        ((kv, 256), "none"),
        ((kv, 256), "none"),
        ((256, 256), "none"),  # Q K V O
        *([((1024, 256), "none")] * 2 if gated else [((1024, 256), epilogue)]),
        ((256, 1024), "none"),
    ]
    with torch.no_grad():
        plain = model32.run(tokens)[0]
        assert sorted(onednn_calls) == sorted(per_layer * 2 + [((600, 256), "none")])  # and the unembedding
        logits32, cache32 = model32.run(tokens, names=hooks)
        logits64, cache64 = model64.run(tokens, names=hooks)
    assert (logits32.double() - logits64).abs().max() <= 1e-5 * logits64.abs().max()
    assert (plain.double() - logits64).abs().max() <= 1e-5 * logits64.abs().max()
    for name in hooks:
        assert (cache32[name].double() - cache64[name]).abs().max() <= 1e-5 * cache64[name].abs().max(), name
    if not gated:
        pre, post = cache32["blocks.0.mlp.hook_pre"], cache32["blocks.0.mlp.hook_post"]
        assert torch.equal(post, TORCH_ACTS[act_fn](pre)) and not torch.equal(pre, post)


def test_float32_grams_equal_float64():
    """embed_grams in float32 (G's chunks and G_E's blocks through MKL's products, whatever linear.affine uses, each LN
    chunk written over the last, float64 totals) against W_U @ W_E_eff and W_E_eff^T @ W_E_eff formed densely in
    float64, over uneven chunks."""
    model32, model64 = _model("gelu_new", torch.float32), _model("gelu_new", torch.float64)
    G, G_E = copying_spectra.embed_grams(model32, shared_chunks(600, 512))  # chunks of 512 rows and 88
    E = embedding.embed_eff(model64)  # [V, d] float64
    want_G, want_G_E = model64.W_U @ E, E.T @ E
    assert (G.double() - want_G).abs().max() <= 2e-6 * want_G.abs().max()
    assert (G_E.double() - want_G_E).abs().max() <= 2e-6 * want_G_E.abs().max()


def test_the_private_onednn_op_linear_calls_still_exists_and_computes_x_W_plus_b_then_gelu() -> None:
    """linear.affine calls torch.ops.mkldnn._linear_pointwise, private to torch: a torch release that drops it or
    changes its arguments must fail here, not fall back to addmm unnoticed (or break every product)."""
    assert torch.backends.mkldnn.is_available(), "this torch build has no oneDNN: linear.affine uses addmm only"
    op = torch.ops.mkldnn._linear_pointwise  # AttributeError: the op is gone
    gen = torch.Generator().manual_seed(0)
    x, W, b = torch.randn(64, 96, generator=gen), torch.randn(96, 80, generator=gen), torch.randn(80, generator=gen)
    got = op(x, W.t().contiguous(), b, "gelu", [], "tanh")  # the call affine makes: W.t() [n_out, n_in]
    want = F.gelu(x.double() @ W.double() + b.double(), approximate="tanh")
    assert got.shape == (64, 80) and torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)
    if os.environ.get(linear.ONEDNN_SWITCH) is None:
        assert linear._ONEDNN_LINEAR is op  # linear.py found it (the switch is on by default)


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("1", True), ("", True)])
def test_qkov_onednn_switches_the_onednn_path(value: str, on: bool) -> None:
    code = "from circuits_core.model import linear; print(linear._ONEDNN_LINEAR is not None)"
    env = {**os.environ, linear.ONEDNN_SWITCH: value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(on)


def test_a_bad_qkov_onednn_value_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="QKOV_ONEDNN must be 1 or 0"):
        linear.onednn_wanted("maybe")
