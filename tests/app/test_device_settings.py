"""QKOV_DEVICE and the budgets that follow it (app/settings.py).

The device is resolved in one place (Settings.compute_device): auto is the CPU on a machine where torch sees no GPU,
a GPU asked for but absent is an error naming what torch sees. On a GPU (torch's CUDA queries stood in for here)
`on_device` gives the app the GPU's budgets; on the CPU the settings stay as they are. The order-2 path expansion of
128 tokens at Llama-3.1-8B shape, priced by the paths analysis's own cost function on a model built on the meta
device (no memory spent), is within the GPU's default request budget, with and without the split by source.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from app.params import PathsParams
from app.settings import Limits, Settings
from app.views.prompt import paths_cost
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer

LLAMA_3_1_8B = ModelConfig(
    n_layers=32, d_model=4096, n_heads=32, d_head=128, d_vocab=128256, n_ctx=131072, attn_only=False, d_mlp=14336,
    normalization_type="RMSPre", positional_embedding_type="rotary", gated_mlp=True, act_fn="silu",
    n_key_value_heads=8, rotary_dim=128, rotary_base=500000.0,
)  # fmt: skip


def test_the_device_setting() -> None:
    assert not torch.cuda.is_available()  # (this suite runs on the CPU)
    assert Settings().compute_device() == torch.device("cpu")  # auto
    assert Settings(device="cpu").compute_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="torch sees 0 CUDA"):
        Settings(device="cuda:1").compute_device()
    with pytest.raises(ValidationError):
        Settings(device="tpu")
    cpu = Settings()
    assert cpu.on_device() is cpu and not cpu.keeps_half_weights()
    assert Settings(half_weights="keep").keeps_half_weights()


def test_budgets_follow_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    settings = Settings(device="cuda:1")
    assert settings.compute_device() == torch.device("cuda:1") and settings.keeps_half_weights()
    gpu = settings.on_device()
    assert gpu.limits.peak_bytes == settings.gpu_peak_bytes != settings.limits.peak_bytes
    assert gpu.max_model_bytes == settings.gpu_max_model_bytes
    assert gpu.compute_flops_per_s == settings.gpu_flops_per_s
    assert gpu.limits.max_k == settings.limits.max_k  # the other limits are the device's too
    assert Settings().compute_device() == torch.device("cuda")  # auto: a GPU when torch sees one


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # kept as stored on a GPU / converted
@pytest.mark.parametrize("by_source", [False, True])
def test_order_2_paths_of_128_tokens_at_8b_fit_the_gpu_budget(by_source: bool, dtype: torch.dtype) -> None:
    with torch.device("meta"):
        model = Transformer(LLAMA_3_1_8B).to(dtype)
    loaded = LoadedModel(model=model, tokenizer=None, format="llama")
    params = PathsParams(tokens=",".join(str(i) for i in range(128)), max_order=2, by_source=by_source)
    cost = paths_cost(loaded, params, Limits())
    assert cost.peak_bytes <= Settings().gpu_peak_bytes
