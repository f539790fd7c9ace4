"""Virtual-weight scores against TransformerLens 3.9.0 on a checkpoint TL wrote: a 2-layer LN MLP model with
standard positions, processed by TL's own process_weights_() (LNPre), saved as a TL state dict and loaded by qkov.
Each pair is recomputed the way TL users do it, with TL's FactoredMatrix and TL's LNPre module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformer_lens import FactoredMatrix as TLFactored
from transformer_lens import HookedTransformer, HookedTransformerConfig

from circuits_core.circuits import virtual_weight_table as vwt
from circuits_core.formats.checkpoint import load_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[HookedTransformer, object]:
    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_head=8,
        d_vocab=41,
        n_ctx=12,
        d_mlp=24,
        act_fn="gelu_new",
        normalization_type="LN",
        positional_embedding_type="standard",
        dtype=torch.float64,
        seed=3,
    )
    tl = HookedTransformer(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in tl.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(
                1 + 0.3 * noise if leaf == "w" else 0.3 * noise if leaf.startswith("b") else noise / p.shape[-2] ** 0.5
            )
    tl.process_weights_()  # fold LN, centre writers and the unembedding, fold value biases: TL's own processing
    folder = tmp_path_factory.mktemp("tl_vw")
    config = {k: str(v) if isinstance(v, torch.dtype | torch.device) else v for k, v in tl.cfg.to_dict().items()}
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(tl.state_dict(), Path(folder) / "model.pth")
    return tl.eval().requires_grad_(False), load_checkpoint(folder, dtype=torch.float64, process=False).model


def _score(a: TLFactored, b: TLFactored) -> float:
    return float((a @ b).norm() / (a.norm() * b.norm()))


def test_scores_equal_transformer_lens_factored_products(pair) -> None:  # type: ignore[no-untyped-def]
    tl, model = pair
    assert tl.cfg.normalization_type == "LNPre" and model.cfg.normalization_type == "LNPre"
    s = vwt.all_scores(model)
    col = {r.name: j for j, r in enumerate(s.readers)}
    row = {w.name: i for i, w in enumerate(s.writers)}
    eye = torch.eye(tl.cfg.d_model, dtype=torch.float64)
    W_E_ln = tl.blocks[0].ln1(tl.W_E[None])[0]  # TL's LNPre on each embedding row
    writers = {
        "embed": TLFactored(W_E_ln, eye),
        "pos": TLFactored(tl.W_pos, eye),
        "L0.mlp": TLFactored(tl.W_out[0], eye),
    }
    writers |= {f"L{layer}H{h}": tl.OV[layer, h] for layer in range(2) for h in range(2)}
    readers = {"unembed": TLFactored(eye, tl.W_U), "L1.mlp.in": TLFactored(eye, tl.W_in[1])}
    for h in range(2):
        readers |= {f"L1H{h}.Q": tl.QK[1, h], f"L1H{h}.K": tl.QK[1, h].T, f"L1H{h}.V": tl.OV[1, h]}
    checked = 0
    for w, a in writers.items():
        for r, b in readers.items():
            if w.startswith("L1H") and r.startswith("L1H"):
                continue  # same layer: not read
            assert float(s.raw[row[w], col[r]]) == pytest.approx(_score(a, b), rel=1e-9), (w, r)
            checked += 1
    assert checked == 5 * 8 + 2 * 2  # embed, pos, L0.mlp, L0 heads to all 8 readers; L1 heads to unembed, L1.mlp.in
