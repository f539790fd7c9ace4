"""When Gemma-3's tokenizer is built (formats/gguf_tokenizer.py, read_gguf): on its worker thread once the weights
are read, never beside the read (it took a core from it and stalled its threads on the GIL), and still after a read
that fails (else the one worker waits for ever and no later GGUF tokenizer is ever built).

On the real Q4_K_M file (`make gemma3`), with the weights' read replaced by a stand-in that records what the builder
did meanwhile: the vocabulary's build (4 CPU-s) is what is timed here, not the weights'."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from circuits_core.formats import gguf, gguf_tokenizer
from circuits_core.formats.gguf import read_gguf

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


def wait_built(tokenizer: Any) -> None:
    """tokenizer.hf within BUILD_TIMEOUT_S (a builder waiting on a gate nobody sets would hang the suite)."""
    done = threading.Event()

    def build() -> None:
        tokenizer.hf  # noqa: B018 - waits for the build
        done.set()

    threading.Thread(target=build, daemon=True).start()
    assert done.wait(BUILD_TIMEOUT_S), "the tokenizer was never built: its builder is waiting for a gate"
