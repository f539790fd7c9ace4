"""Engine functions with the model on another device than the host (tests/foreign_device.py), beside the
registered analyses (tests/app/test_device_clean.py): the virtual weights of every pair, which crashed on CUDA
("Expected all tensors to be on the same device, cuda:0 and cpu"), at offset 0 and at a rotary offset, on a
GQA/rotary/SwiGLU model and on a shortformer one (whose position writer has its own reach row)."""

from __future__ import annotations

import pytest
import torch

from circuits_core.circuits import virtual_weight_table as vwt
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from tests.foreign_device import ForeignDevice

LLAMA_LIKE = ModelConfig(
    n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=40, n_ctx=64, attn_only=False, d_mlp=48,
    normalization_type="RMSPre", positional_embedding_type="rotary", gated_mlp=True, act_fn="silu",
    n_key_value_heads=2, rotary_dim=8,
)  # fmt: skip
SHORTFORMER = ModelConfig(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=30, n_ctx=12)


@pytest.mark.parametrize(("cfg", "offset"), [(LLAMA_LIKE, 0), (LLAMA_LIKE, 3), (SHORTFORMER, 0)])
def test_virtual_weight_scores_stay_on_the_models_device(cfg: ModelConfig, offset: int) -> None:
    host = vwt.all_scores(random_model(cfg, seed=3, dtype=torch.float64), offset=offset)
    model = random_model(cfg, seed=3, dtype=torch.float64)  # a twin: nothing cached for it on the host
    with ForeignDevice(model) as mode:
        scores = vwt.all_scores(model, offset=offset)
        assert mode.is_foreign(scores.raw) and mode.place(scores.mask) != "host"
    torch.testing.assert_close(scores.raw, host.raw, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh)")
@pytest.mark.parametrize(("cfg", "offset"), [(LLAMA_LIKE, 0), (LLAMA_LIKE, 3), (SHORTFORMER, 0)])
def test_virtual_weight_scores_on_cuda_equal_the_cpus(cfg: ModelConfig, offset: int) -> None:
    host = vwt.all_scores(random_model(cfg, seed=3, dtype=torch.float64), offset=offset)
    gpu = vwt.all_scores(random_model(cfg, seed=3, dtype=torch.float64).to("cuda"), offset=offset)
    assert gpu.raw.device.type == "cuda"
    torch.testing.assert_close(gpu.raw.cpu(), host.raw, rtol=1e-12, atol=1e-12)
