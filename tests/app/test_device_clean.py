"""Every registered analysis with the model on another device than the host (issue: a GPU as a first-class device).

CI has no GPU, so the model's tensors are tagged as lying on a foreign device (tests/foreign_device.py): an op
mixing them with a tensor created without the model's device fails as it would on CUDA ("Expected all tensors to be
on the same device"), while every value is still computed, eigenvalues and SVDs included. Each analysis of
app/catalog.py runs, through its declared builder and its price, on three models between them covering every
feature an analysis branches on: shortformer positions without norms (tiny-2l), LayerNorm with standard positions
(tiny-ln), a Llama-like model (RMS norm, rotary, grouped-query attention, gated MLP), and the shipped toy-2l, whose
trained induction head the analyses built around one need. An analysis a model does
not support (rotary-only views on a learned-position model) may refuse it with a 4xx error; every analysis must run
clean on at least one model, and must have read the model's tensors there. The tables ranked over a token subset
run once more on one, since their positions index host token ids: min_count's, and a large vocabulary's default set
(DEFAULT_VOCAB lowered below the models' vocabulary, so that every such table ranks a subset by default).

Every analysis also gives the same answer where torch's backend-chosen answers come out otherwise (the order of
equal values in topk and unstable sorts, the signs of singular vectors and eigenvectors: tests/another_backend.py),
and, with a CUDA GPU present (bench/gpu_check.sh), it runs there in float64 and must give the CPU's answer, but for
the device its answer names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import app.views.shared.token_sets as token_sets
from app.analysis import Analysis, BoundAnalyses
from app.catalog import ANALYSES
from app.settings import REPO_ROOT
from circuits_core import schedule
from circuits_core.circuits import gram_pair_sums
from circuits_core.errors import InvalidInputError, LimitExceededError, NotFoundError
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.prompt.phenomena import TOKEN_COUNTS_FILE
from tests.another_backend import AnotherBackend
from tests.app.conftest import LIMITS, save_qkov, train_tokenizer
from tests.foreign_device import DeviceMixError, ForeignDevice

PATH_VALUES = {"head": "L1H0", "source": "L0H1", "target": "L1H2", "writer": "L0H1", "reader": "L1H0.K"}
QUERY_VALUES = {"tokens": "5,6,7,8,5,6,7,8,9", "heads": "L0H1,L1H2", "head": "L1H0", "k": 7}
MODEL_ANALYSES = [a for a in ANALYSES if a.scope == "model"]
REFUSALS = (InvalidInputError, NotFoundError, LimitExceededError)  # 4xx answers: the model lacks the feature


def llama_like(vocab: int) -> ModelConfig:
    return ModelConfig(
        n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=vocab, n_ctx=64, attn_only=False, d_mlp=48,
        normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True, act_fn="silu",
        n_key_value_heads=2, rotary_dim=8,
    )  # fmt: skip


@pytest.fixture(scope="module")
def models(model_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """name -> (loaded model, its ForeignDevice mode: one per model, so buffers an analysis keeps stay tagged)."""
    tok = train_tokenizer()
    folder = tmp_path_factory.mktemp("device") / "tiny-llama"
    save_qkov(folder, llama_like(tok.get_vocab_size()), tok, seed=5)
    counts = np.random.default_rng(1).integers(0, 1000, tok.get_vocab_size())  # training counts, for min_count
    np.save(folder / TOKEN_COUNTS_FILE, counts)
    shipped, user = model_dirs
    out = {}
    toy = REPO_ROOT / "checkpoints" / "toy-2l"  # trained: it has the induction head some analyses need
    for name, path in (
        ("tiny-2l", shipped / "tiny-2l"),
        ("tiny-ln", user / "tiny-ln"),
        ("tiny-llama", folder),
        ("toy-2l", toy),
    ):
        loaded = load_checkpoint(path, dtype=torch.float64)
        out[name] = (loaded, ForeignDevice(loaded.model))
    return out


@pytest.fixture(autouse=True)
def one_thread_of_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch function mode watches its own thread only, so every step runs in this one: the engine is told the
    process has one core. schedule.side_by_side then runs its two branches in turn (head_table's halves included,
    which on two cores schedule.halves_side_by_side gives one thread each), and gram_pair_sums keeps to one worker."""
    for module in (schedule, gram_pair_sums):
        monkeypatch.setattr(module, "available_cores", lambda: 1)


def run_on_foreign_device(
    analysis: Analysis[Any, Any], loaded: LoadedModel, mode: ForeignDevice, values: dict[str, Any] = QUERY_VALUES
) -> tuple[int, dict[str, Any]]:
    """Price and build the analysis with the model's tensors tagged; the number of ops that read them, the answer."""
    bound = BoundAnalyses(MODEL_ANALYSES, LIMITS)
    path_fields = analysis.path_fields()
    raw = {k: v for k, v in values.items() if k in analysis.params.model_fields and k not in path_fields}
    raw |= {k: PATH_VALUES[k] for k in path_fields}
    params = bound.bound(analysis).model_validate(raw).normalised(loaded)
    before = mode.foreign_ops
    with mode:
        analysis.cost(loaded, params, LIMITS)
        answer = analysis.build(loaded, params, LIMITS)
    said = answer.model_dump(mode="json")
    model = said.get("model") or {}  # every answer names the checkpoint it came from
    assert model.get("digest") == str(loaded.digest), f"{analysis.name} names no model: {model}"
    return mode.foreign_ops - before, said


@pytest.mark.parametrize("analysis", MODEL_ANALYSES, ids=[a.name for a in MODEL_ANALYSES])
def test_every_analysis_keeps_to_the_models_device(models: dict[str, Any], analysis: Analysis[Any, Any]) -> None:
    ran, refused = {}, {}
    for name, (loaded, mode) in models.items():
        if name == "toy-2l" and ran:  # the trained model (a 4x larger vocabulary) only where the random ones refuse
            continue
        try:
            ran[name], _ = run_on_foreign_device(analysis, loaded, mode)
        except DeviceMixError as exc:
            raise AssertionError(f"{analysis.name} on {name}: {exc}") from exc
        except REFUSALS as exc:
            refused[name] = str(exc)
    assert ran, f"{analysis.name} ran on none of the models: {refused}"
    if analysis.name != "tokenize":  # (tokenizing reads no weights)
        assert any(n > 0 for n in ran.values()), f"{analysis.name} read no tensor of the model: {ran}"


SUBSET_ANALYSES = [a for a in MODEL_ANALYSES if {"min_count", "vocab"} & a.params.model_fields.keys()]
SMALL_DEFAULT_VOCAB = 100  # DEFAULT_VOCAB here: below the random models' 320 tokens, so each vocabulary is "large"


@pytest.mark.parametrize("analysis", SUBSET_ANALYSES, ids=[a.name for a in SUBSET_ANALYSES])
def test_token_subsets_keep_to_the_models_device(
    models: dict[str, Any], analysis: Analysis[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tables ranked over a token subset index host token ids by positions the circuit computed on the model's
    device: min_count's frequent tokens (tiny-2l and tiny-llama have training counts), and a large vocabulary's
    default set, with DEFAULT_VOCAB lowered below the models' vocabulary as on a 128k-token model: its
    SMALL_DEFAULT_VOCAB most frequent tokens (tiny-2l, tiny-llama), or its lowest ids (tiny-ln has no counts)."""
    monkeypatch.setattr(token_sets, "DEFAULT_VOCAB", SMALL_DEFAULT_VOCAB)
    runs = [(name, "the default set", {}) for name in ("tiny-2l", "tiny-ln", "tiny-llama")]
    if "min_count" in analysis.params.model_fields:
        runs += [(name, "min_count=500", {"min_count": 500}) for name in ("tiny-2l", "tiny-llama")]
    ran, refused = {}, {}
    for name, subset, values in runs:
        loaded, mode = models[name]
        try:
            ran[name, subset], answer = run_on_foreign_device(analysis, loaded, mode, QUERY_VALUES | values)
        except DeviceMixError as exc:
            raise AssertionError(f"{analysis.name} on {name}, {subset}: {exc}") from exc
        except REFUSALS as exc:
            refused[name, subset] = str(exc)
            continue
        if not values and "token_set" in answer:  # the answer states the default set it ranked
            assert f"{SMALL_DEFAULT_VOCAB:,}" in (answer["token_set"] or ""), f"{analysis.name}: {answer['token_set']}"
    for subset in {subset for _, subset, _ in runs}:
        reads = [n for (_, ran_on), n in ran.items() if ran_on == subset]
        assert any(n > 0 for n in reads), f"{analysis.name} ran on no model's {subset}: {ran} {refused}"


def test_the_check_fails_on_a_host_tensor_mixed_in() -> None:
    """The mode itself: a host tensor meeting the model's fails, and the ways of following the model pass."""
    model = torch.nn.Linear(4, 3)
    with ForeignDevice(model) as mode:
        W = model.weight  # [3, 4]
        W @ torch.ones(4, device=W.device)  # a factory told the device
        with pytest.raises(DeviceMixError, match="same device"):  # ... which is the model's: the host's is not
            torch.eq(torch.arange(3, device=W.device)[:, None], torch.arange(4)[None, :])
        W @ torch.ones(4).to(W.device)  # moved there
        W[torch.tensor([0, 2])]  # host indices into a device tensor: allowed, as on CUDA
        W * torch.tensor(2.0)  # a 0-dim host scalar: allowed, as on CUDA
        torch.linalg.eigvals(W[:, :3]).abs().max().item()  # computed for real
        with pytest.raises(DeviceMixError, match="same device"):
            W @ torch.ones(4)
        with pytest.raises(DeviceMixError, match="same device"):
            torch.where(torch.ones(3, 4, dtype=torch.bool), W, torch.zeros_like(W))
        with pytest.raises(DeviceMixError, match="same device"):
            W.cpu() @ W.T  # .cpu() is the host
    assert mode.foreign_ops > 0


def test_the_check_indexes_as_aten_does() -> None:
    """The mode on indexing (ATen's rules, tests/foreign_device.py): host token ids read at positions on the model's
    device fail, as the composition-pair table's did on an H200; what CUDA accepts passes."""
    model = torch.nn.Linear(4, 3)
    with ForeignDevice(model) as mode:
        W = model.weight  # [3, 4]
        ids = torch.arange(10, 20)  # host token ids [10]
        at = W.detach().abs().sum(1).topk(2).indices  # positions [2], on the model's device
        host_at = torch.tensor([0, 2])
        refused = {
            "ids[at]": lambda: ids[at],
            "ids[:, None][at, 0]": lambda: ids[:, None][at, 0],
            "ids[mask]": lambda: ids[torch.ones(10, dtype=torch.bool, device=W.device)],
            "aten.index(ids, [at])": lambda: torch.ops.aten.index.Tensor(ids, [at]),
            "aten.index(ids, [at[0]])": lambda: torch.ops.aten.index.Tensor(ids, [at[0]]),  # no .item() in aten
            "ids.index_select(0, at)": lambda: ids.index_select(0, at),
            "gather(ids, 0, at)": lambda: torch.gather(ids, 0, at),
            "take(ids, at)": lambda: torch.take(ids, at),
            "take_along_dim(ids, at)": lambda: torch.take_along_dim(ids, at),
            "W.index_select(0, host 0-dim)": lambda: W.index_select(0, torch.tensor(1)),  # no scalar exception
            "W[host_at] = host [2, 4]": lambda: W.detach().clone().index_put_((host_at,), torch.zeros(2, 4)),
            "ids[host_at] = [2] on the device": lambda: ids.clone().index_put_((host_at,), at.clone()),
        }
        for said, index in refused.items():
            with pytest.raises(DeviceMixError, match="device"):
                index()
                pytest.fail(f"{said} passed")
        assert mode.is_foreign(W[host_at])  # host indices into the model's tensor: CUDA moves them
        assert mode.is_foreign(W[torch.tensor([True, False, True])])  # a host mask, likewise
        assert mode.is_foreign(torch.ops.aten.index.Tensor(W, [host_at]))
        assert mode.place(ids[at.cpu()]) == "host"  # the positions brought to the host first
        assert mode.is_foreign(ids.to(W.device)[at])  # or the ids sent to the device
        assert mode.place(ids[at[0]]) == "host"  # a 0-dim index: Python indexing reads it as a number (.item())
        ids.clone()[at] = 0  # t[index] = v moves the indices to t's device ...
        ids.clone()[at] = at[0]  # ... and a 0-dim value
        W.detach().clone()[:2] = torch.zeros(4)  # no index tensor: a copy, across devices


# -- another backend's answers: on the CPU (AnotherBackend), on a real GPU (bench/gpu_check.sh) ---------------------
def answer(analysis: Analysis[Any, Any], subject: LoadedModel) -> Any:
    """The analysis's JSON answer on the model (the test's params), or ("refused", the error's class)."""
    bound = BoundAnalyses(MODEL_ANALYSES, LIMITS)
    path_fields = analysis.path_fields()
    raw = {k: v for k, v in QUERY_VALUES.items() if k in analysis.params.model_fields and k not in path_fields}
    raw |= {k: PATH_VALUES[k] for k in path_fields}
    try:
        params = bound.bound(analysis).model_validate(raw).normalised(subject)
        return analysis.build(subject, params, LIMITS).model_dump(mode="json")
    except REFUSALS as exc:
        return ("refused", type(exc).__name__)


def close(a: Any, b: Any, where: str = "") -> None:
    """Two JSON-like answers equal, numbers to 1e-9 (relative to their size, at least 1)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(a, bool):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(a)), f"{where}: {a} (CPU) vs {b} (the other backend)"
    else:
        assert a == b, f"{where}: {a!r} (CPU) vs {b!r} (the other backend)"


@pytest.mark.parametrize("analysis", MODEL_ANALYSES, ids=[a.name for a in MODEL_ANALYSES])
def test_every_analysis_gives_the_same_answer_on_another_backend(
    models: dict[str, Any], analysis: Analysis[Any, Any]
) -> None:
    """What torch leaves to the backend given otherwise than the CPU gives it (tests/another_backend.py: equal values
    in topk and unstable sorts in reverse index order, singular vectors and eigenvectors negated): the same answers,
    as on a GPU (the CUDA test below found a path ranking and a singular direction's sign that were not)."""
    for name, (loaded, _) in models.items():
        cpu = answer(analysis, loaded)
        with AnotherBackend():
            other = answer(analysis, loaded)
        close(cpu, other, f"{analysis.name} on {name}")


def the_cpus_answers_on_cuda(models: dict[str, Any], analysis: Analysis[Any, Any]) -> None:
    """Each model loaded again on the GPU in float64 gives the CPU's answer, but for the device its answer names."""
    ran = 0
    for name, (loaded, _) in models.items():
        on_gpu = load_checkpoint(loaded.path, dtype=torch.float64, device="cuda")
        assert on_gpu.provenance()["device"].startswith("cuda")
        answers = [answer(analysis, subject) for subject in (loaded, on_gpu)]
        cpu, gpu = answers
        if not isinstance(gpu, tuple):  # the answer says where it was computed; the rest is the CPU's answer
            device = str(on_gpu.model.device)
            assert gpu["model"]["device"] == device, f"{analysis.name} on {name}: the answer names no GPU"
            said = json.dumps(gpu)
            assert f"on {device}" in said, f"{analysis.name} on {name}: its provenance names no GPU"
            gpu = json.loads(said.replace(f"on {device}", "on cpu"))
            gpu["model"]["device"] = "cpu"
        close(cpu, gpu, f"{analysis.name} on {name}")
        ran += answers[0][0] != "refused" if isinstance(answers[0], tuple) else 1
    assert ran, f"{analysis.name} ran on no model"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh)")
@pytest.mark.parametrize("analysis", MODEL_ANALYSES, ids=[a.name for a in MODEL_ANALYSES])
def test_every_analysis_gives_the_cpus_answer_on_cuda(models: dict[str, Any], analysis: Analysis[Any, Any]) -> None:
    the_cpus_answers_on_cuda(models, analysis)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh)")
@pytest.mark.parametrize("analysis", SUBSET_ANALYSES, ids=[a.name for a in SUBSET_ANALYSES])
def test_every_token_subset_gives_the_cpus_answer_on_cuda(
    models: dict[str, Any], analysis: Analysis[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tables ranked over a large vocabulary's default set (DEFAULT_VOCAB lowered below the models' vocabulary,
    as in test_token_subsets_keep_to_the_models_device): the composition-pair table crashed there on an H200."""
    monkeypatch.setattr(token_sets, "DEFAULT_VOCAB", SMALL_DEFAULT_VOCAB)
    the_cpus_answers_on_cuda(models, analysis)
