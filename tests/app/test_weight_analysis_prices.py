"""Weight-only analyses' prices (their declared costs) against the memory their builders hold: the direct, OV and QK
tables, and the per-head OV effective rank, OV top singular share, QK circuit norm and rotary band energies.

On a Llama-shaped checkpoint that transformers writes here in bf16, its vocabulary 8x the ranked token set
(DEFAULT_VOCAB), loaded with its bf16 weights kept (float32 compute, as on a GPU), in float32 and in float64. The held
peak is counted by `HeldBytes` (tests/held_bytes.py), a dispatch mode that records the peak bytes of the storages the
tensors made inside it keep alive (the model's weights excluded), checked after every op. The price must cover it, and
not as a blanket bound (within 2x). An 8B-shaped model on an H200 took 1.10 GiB for a direct table priced at 0.44 GiB:
ln_final ran on every row of W_E (the ranked set is 6% of them), and a bf16 model's norm temporaries (float32) and
gathered rows were priced as the every-token factors [d_vocab, d_head] are; the OV and QK tables of a 70B shape took
0.31 GiB for 0.26. The per-head analyses loop over layers, and a layer's float64 weights were still held while the
next layer's were made (priced as one layer's); the band energies' stacking of W_K was not priced. The analyses that
form a vocabulary Gram (copying's eigenvalue scores, the QK copying at each offset, the random copying baseline) held
three [d_model, d_model] float64 temporaries to mirror G_E and an unasked zero total (on an H200 at the 8B shape 0.67
GiB for 0.37 and 0.16 priced), and their chunks of W_E_eff, the first use's statistics, copying's factors on the ranked
tokens and the baseline's two float64 draws at once were priced short or not at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from app.catalog import ANALYSES
from app.params import DEFAULT_VOCAB
from app.settings import Limits
from circuits_core import schedule
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from tests.bf16_llama import save_bf16_llama
from tests.held_bytes import HeldBytes

CONFIG = {"vocab_size": 8 * DEFAULT_VOCAB, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False}  # fmt: skip
LIMITS = Limits(max_k=200, matrix_budget_bytes=2**20, peak_bytes=2**40)  # small search tiles: the factors dominate
DTYPES = (torch.float32, torch.float64)
PER_HEAD = {
    "ov-effective-rank": {},
    "ov-top-singular-share": {},
    "qk-circuit-norm": {},
    "rotary-bands": {"head": "L1H0"},
}
REQUESTS = {"direct": {}, "ov": {"head": "L1H0"}, "qk": {"head": "L1H0"}}
VOCABULARY_GRAMS = {
    "copying": {"head": "L1H0"},
    "qk-copying-offset": {"head": "L1H0"},
    "copying-all": {"samples": 1000},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bf16_llama(tmp_path_factory.mktemp("prices"), CONFIG, seed=0)


@pytest.fixture(scope="module")
def models(folder: Path) -> dict[str, LoadedModel]:
    half = load_checkpoint(folder, keep_half=True)
    assert half.model.W_E.dtype == torch.bfloat16 and half.model.compute_dtype == torch.float32
    return {"bf16-kept": half} | {str(d).removeprefix("torch."): load_checkpoint(folder, dtype=d) for d in DTYPES}


@pytest.mark.parametrize(
    ("kind", "name", "vocab"),
    [
        *[(kind, name, "default") for kind in ("bf16-kept", "float32", "float64") for name in REQUESTS],
        ("float64", "direct", "all"),
    ],
)  # (a bf16 direct table over every token: ~20 s of bf16 products on this CPU)
def test_price_covers_the_held_peak(models: dict[str, LoadedModel], kind: str, name: str, vocab: str) -> None:
    loaded = models[kind]
    analysis = next(a for a in ANALYSES if a.name == name)
    params: Any = analysis.params.model_validate({**REQUESTS[name], "vocab": vocab}).normalised(loaded)
    priced = analysis.cost(loaded, params, LIMITS).peak_bytes
    model = loaded.model
    with torch.no_grad(), HeldBytes([*model.parameters(), *model.buffers()]) as held:
        view = analysis.build(loaded, params, LIMITS)
    assert len(view.entries) == params.k and (view.n_tokens == DEFAULT_VOCAB) == (vocab == "default")
    assert 0 < held.peak <= priced, (held.peak, priced)
    assert priced < 2 * held.peak, (held.peak, priced)  # priced from the steps taken, not a blanket bound


@pytest.mark.parametrize("kind", ["bf16-kept", "float32", "float64"])
@pytest.mark.parametrize("name", list(PER_HEAD))
def test_per_head_price_covers_the_held_peak(models: dict[str, LoadedModel], kind: str, name: str) -> None:
    loaded = models[kind]
    analysis = next(a for a in ANALYSES if a.name == name)
    params: Any = analysis.params.model_validate(PER_HEAD[name]).normalised(loaded)
    priced = analysis.cost(loaded, params, LIMITS).peak_bytes
    model = loaded.model
    with torch.no_grad(), HeldBytes([*model.parameters(), *model.buffers()]) as held:
        analysis.build(loaded, params, LIMITS)
    assert 0 < held.peak <= priced, (held.peak, priced)
    assert priced < 2 * held.peak, (held.peak, priced)


def _held_and_priced(loaded: LoadedModel, name: str, request: dict[str, str]) -> tuple[int, int]:
    analysis = next(a for a in ANALYSES if a.name == name)
    params: Any = analysis.params.model_validate(request).normalised(loaded)
    priced = analysis.cost(loaded, params, LIMITS).peak_bytes
    model = loaded.model
    with torch.no_grad(), HeldBytes([*model.parameters(), *model.buffers()]) as held:
        analysis.build(loaded, params, LIMITS)
    return held.peak, priced


@pytest.mark.parametrize("kind", ["bf16-kept", "float32", "float64"])
@pytest.mark.parametrize("name", list(VOCABULARY_GRAMS))
def test_vocabulary_gram_price_covers_the_held_peak(
    models: dict[str, LoadedModel], kind: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copying-all draws the random baseline's weights (1,000 samples: they dominate) and forms their eigenvalue scores
    beside the heads' rows, on another thread when a core is idle: HeldBytes watches its own thread only, so the
    engine is told the process has one core (schedule.side_by_side runs the two in turn; the price adds them)."""
    monkeypatch.setattr(schedule, "available_cores", lambda: 1)
    held, priced = _held_and_priced(models[kind], name, VOCABULARY_GRAMS[name])
    assert 0 < held <= priced, (held, priced)
    assert priced < 2 * held, (held, priced)


@pytest.mark.parametrize("kind", ["bf16-kept", "float32"])
def test_first_use_prices_the_statistics_it_forms(folder: Path, kind: str) -> None:
    """A model's first vocabulary Gram also forms W_E_eff's per-token statistics (embedding.embed_norm, kept), through
    a float64 chunk: on a fresh load the price counts them, once kept it does not."""
    loaded = load_checkpoint(folder, keep_half=True) if kind == "bf16-kept" else load_checkpoint(folder)
    first = _held_and_priced(loaded, "qk-copying-offset", {"head": "L1H0"})
    second = _held_and_priced(loaded, "qk-copying-offset", {"head": "L1H0"})
    for held, priced in (first, second):
        assert 0 < held <= priced < 2 * held, (held, priced)
    assert first[1] >= second[1]
