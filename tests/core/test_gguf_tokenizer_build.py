"""When Gemma-3's tokenizer is built (formats/gguf_tokenizer.py, read_gguf, load_checkpoint): on its worker thread
once the weights are read (read_gguf alone), or once the whole model is built (load_checkpoint), never beside the
read or the rest of the load (it took a core from them and stalled their threads on the GIL), and still after a read
or load that fails (else the one worker waits for ever and no later GGUF tokenizer is ever built).

On the real Q4_K_M file (`make gemma3`), with the weights' read and the model's build replaced by stand-ins that
record what the builder did meanwhile: the vocabulary's build (3-4 CPU-s) is what is timed here, not the weights'."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from circuits_core.formats import checkpoint, gguf, gguf_tokenizer
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.gguf import read_gguf
from circuits_core.formats.processing import ProcessingOptions
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model

FILE = Path(__file__).resolve().parents[2] / "models" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemma3")]
BUILD_TIMEOUT_S = 300


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The times at which a SentencePiece build starts."""
    if not FILE.is_file():
        pytest.fail(f"{FILE} is missing: run `make gemma3` (`make test` runs it first)")
    started: list[float] = []
    build = gguf_tokenizer.sentencepiece_bpe

    def recorded(*args: Any) -> Any:
        started.append(time.perf_counter())
        return build(*args)

    monkeypatch.setattr(gguf_tokenizer, "sentencepiece_bpe", recorded)
    return started


def test_the_vocabulary_is_built_after_the_weights_are_read(
    builds: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[tuple[float, float]] = []

    def weights(*args: Any) -> dict[str, Any]:  # a read long enough for a builder started beside it to start
        began = time.perf_counter()
        time.sleep(1.0)
        read.append((began, time.perf_counter()))
        return {}

    monkeypatch.setattr(gguf, "gguf_state", weights)
    tokenizer = read_gguf(FILE).tokenizer
    assert tokenizer is not None
    wait_built(tokenizer)
    (began, ended), (started,) = read[0], builds
    assert started >= ended > began  # not beside the read
    assert tokenizer.encode("The capital of France is", prepend_bos=False)  # built whole


def test_a_failed_read_still_lets_the_next_vocabulary_build(
    builds: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(*args: Any) -> dict[str, Any]:
        raise RuntimeError("the weights' read failed")

    monkeypatch.setattr(gguf, "gguf_state", failing)
    with pytest.raises(RuntimeError, match="the weights' read failed"):
        read_gguf(FILE)
    monkeypatch.setattr(gguf, "gguf_state", lambda *args: {})
    tokenizer = read_gguf(FILE).tokenizer
    assert tokenizer is not None
    wait_built(tokenizer)
    assert len(builds) == 2  # the failed read's build ran too (its gate was set), then this one


def built_after(seconds: float, built: list[tuple[float, float]], fail: bool = False) -> Any:
    """A stand-in for load_checkpoint's steps after the read (checks, processing, the model's construction) that takes
    `seconds`, records when it ran in `built`, then returns a small model with the read's tokenizer (or fails)."""

    def build(*args: Any) -> Any:
        began = time.perf_counter()
        time.sleep(seconds)
        built.append((began, time.perf_counter()))
        if fail:
            raise RuntimeError("the model's build failed")
        model = random_model(ModelConfig(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=8))
        return checkpoint._Built(model=model, tokenizer=args[8], card={}, options=ProcessingOptions())

    return build


def test_a_load_builds_the_vocabulary_once_the_model_is_built(
    builds: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not when the weights are read: the non-finite check, processing and the model's construction come after the
    read, and beside the build they stalled on the GIL (the whole load 6.2 s instead of 3.2)."""
    built: list[tuple[float, float]] = []
    monkeypatch.setattr(gguf, "gguf_state", lambda *args: {})
    monkeypatch.setattr(checkpoint, "_build", built_after(1.0, built))
    tokenizer = load_checkpoint(FILE.parent).tokenizer
    assert tokenizer is not None
    wait_built(tokenizer)
    (began, ended), (started,) = built[0], builds
    assert started >= ended > began  # not beside the model's build
    assert tokenizer.encode("The capital of France is", prepend_bos=False)  # built whole


def test_a_failed_load_still_lets_the_next_vocabulary_build(
    builds: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[tuple[float, float]] = []
    monkeypatch.setattr(gguf, "gguf_state", lambda *args: {})
    monkeypatch.setattr(checkpoint, "_build", built_after(0.0, built, fail=True))
    with pytest.raises(RuntimeError, match="the model's build failed"):
        load_checkpoint(FILE.parent)
    monkeypatch.setattr(checkpoint, "_build", built_after(0.0, built))
    tokenizer = load_checkpoint(FILE.parent).tokenizer
    assert tokenizer is not None
    wait_built(tokenizer)
    assert len(builds) == 2  # the failed load's build ran too (its gate was set), then this one


def wait_built(tokenizer: Any) -> None:
    """tokenizer.hf within BUILD_TIMEOUT_S (a builder waiting on a gate nobody sets would hang the suite)."""
    done = threading.Event()

    def build() -> None:
        tokenizer.hf  # noqa: B018 - waits for the build
        done.set()

    threading.Thread(target=build, daemon=True).start()
    assert done.wait(BUILD_TIMEOUT_S), "the tokenizer was never built: its builder is waiting for a gate"
