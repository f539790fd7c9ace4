"""Weight files truncated while a real server reads them: a uvicorn on 127.0.0.1 whose every tensor read (safetensors)
and chunk read (GGUF) is slowed to 0.15 s (the server process wraps the two readers), so that the test truncates the
file in the middle of a load, or in the middle of the lazy read of a Llama checkpoint's MLP weights after the load.
Each time the request answers a problem+json 422 naming the file, the process stays alive and /healthz answers 200;
through a memory map the truncation was a SIGBUS that killed the server (the qkov/TransformerLens formats read their
safetensors through one until this branch). Folders: a tiny GGUF, a qkov checkpoint and a transformers-written
Llama checkpoint (its MLPs read on first use).

The last test wraps nothing: a plain server loads an 80 MB GGUF, and the test cuts the file to a quarter the moment
the server process has it mapped, or 50 ms after it opened it (polling /proc/<pid>/fd and /proc/<pid>/maps), so it
also runs against code that read GGUF files through a memory map (tests/app/live_server.py:
QKOV_TEST_SERVER_CHECKOUT); there the server died of SIGBUS."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import torch
import transformers

from bench.server import free_port
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from tests.app.live_server import start
from tests.app.test_lazy_weights import CONFIG
from tests.core.test_gguf import write_gguf

pytestmark = pytest.mark.xdist_group("uvicorn")
QKOV = ModelConfig(n_layers=4, d_model=64, n_heads=4, d_head=16, d_vocab=512, n_ctx=32, d_mlp=256, act_fn="gelu")
READ_S = 0.15

SERVER = """
import os, sys, time
import uvicorn
from circuits_core.formats import gguf_header, safetensors_file
pause = float(os.environ["READ_S"])
stored, read_bytes = safetensors_file.SafetensorsFile.stored_bytes, gguf_header.GGUFHeader.read_bytes
def slow_stored(self, *args, **kwargs):
    time.sleep(pause)
    return stored(self, *args, **kwargs)
def slow_read_bytes(self, *args, **kwargs):
    time.sleep(pause)
    return read_bytes(self, *args, **kwargs)
safetensors_file.SafetensorsFile.stored_bytes = slow_stored
gguf_header.GGUFHeader.read_bytes = slow_read_bytes
from app.main import create_app
from app.settings import Settings
uvicorn.run(create_app(Settings()), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("truncated")
    (root / "shipped").mkdir()
    models = root / "models"
    (models / "gg").mkdir(parents=True)
    write_gguf(models / "gg" / "model.gguf")
    save_checkpoint(random_model(QKOV, seed=0, dtype=torch.float32), models / "qk")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(models / "st")
    port = free_port()
    env = {
        "QKOV_SHIPPED_DIR": str(root / "shipped"),
        "QKOV_MODELS_DIR": str(models),
        "QKOV_STORE_URL": "off",
        "QKOV_DEVICE": "cpu",
        "READ_S": str(READ_S),
    }
    proc = start(["-c", SERVER, str(port)], port, env)
    try:
        yield proc, f"http://127.0.0.1:{port}", models
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _truncated_during(url: str, path: Path, after_s: float) -> httpx.Response:
    """GET url in a thread; after `after_s` (the read under way) cut the file to half its length."""
    answer: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: answer.setdefault("r", httpx.get(url, timeout=120)))
    thread.start()
    time.sleep(after_s)
    os.truncate(path, path.stat().st_size // 2)
    thread.join(timeout=150)
    return answer["r"]


def _alive(proc: Any, base: str) -> None:
    assert proc.poll() is None, f"the server died (exit {proc.poll()})"
    assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize(("model", "file"), [("gg", "model.gguf"), ("qk", "model.safetensors")])
def test_a_file_truncated_during_its_load(server: Any, model: str, file: str) -> None:
    proc, base, models = server
    answer = _truncated_during(f"{base}/api/v1/models/{model}", models / model / file, after_s=4 * READ_S)
    assert answer.status_code == 422, (answer.status_code, answer.text[:400])
    assert answer.headers["content-type"].startswith("application/problem+json")
    detail = answer.json()["detail"]
    assert f"model {model!r} cannot be loaded" in detail and file in detail, detail
    assert str(models) not in detail  # never a server path
    _alive(proc, base)


def test_a_file_truncated_while_its_mlp_weights_are_read_lazily(server: Any) -> None:
    proc, base, models = server
    loaded = httpx.get(f"{base}/api/v1/models/st", timeout=120)
    assert loaded.status_code == 200 and "deferred" in loaded.json()["computed_on"]["mlp_weights"], loaded.text[:300]
    # a forward pass reads the 6 MLP matrices on first use, 0.15 s each: cut the file after the second
    answer = _truncated_during(f"{base}/api/v1/models/st/prompt?tokens=1,2,3,4", models / "st" / "model.safetensors",
                               after_s=2.5 * READ_S)  # fmt: skip
    assert answer.status_code == 422, (answer.status_code, answer.text[:400])
    assert "model.safetensors" in answer.json()["detail"], answer.text[:400]
    _alive(proc, base)


MAP_WAIT_S = 0.05
PLAIN_SERVER = """
import sys
import uvicorn
from app.main import create_app
from app.settings import Settings
uvicorn.run(create_app(Settings()), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def _large_gguf(path: Path, d_vocab: int = 16_384, d_model: int = 512, n_layers: int = 2) -> None:
    """A Llama GGUF of float32 tensors, about 80 MB (the embedding and unembedding 32 MiB each): reading it takes
    long enough for a truncation to land in the middle. Its tokenizer is a byte-level vocabulary without merges."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(n_layers)
    writer.add_context_length(64)
    writer.add_embedding_length(d_model)
    writer.add_feed_forward_length(2 * d_model)
    writer.add_head_count(8)
    writer.add_head_count_kv(8)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(d_model // 8)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([f"t{i}" for i in range(d_vocab)])
    writer.add_token_merges([])
    writer.add_bos_token_id(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    writer.add_tensor("token_embd.weight", rand(d_vocab, d_model))
    for layer in range(n_layers):
        b = f"blk.{layer}"
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"{b}.{name}.weight", np.ones(d_model, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{b}.{name}.weight", rand(d_model, d_model))
        for name, shape in (("ffn_gate", (2 * d_model, d_model)), ("ffn_up", (2 * d_model, d_model)),
                            ("ffn_down", (d_model, 2 * d_model))):  # fmt: skip
            writer.add_tensor(f"{b}.{name}.weight", rand(*shape))
    writer.add_tensor("output_norm.weight", np.ones(d_model, dtype=np.float32))
    writer.add_tensor("output.weight", rand(d_vocab, d_model))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _held_by(pid: int, path: Path) -> tuple[bool, bool]:
    """(whether process `pid` holds `path` open by a descriptor, whether it has it memory-mapped)."""
    target, opened = str(path), False
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                opened = opened or os.readlink(f"/proc/{pid}/fd/{fd}") == target
            except OSError:
                continue  # closed meanwhile
        with open(f"/proc/{pid}/maps") as maps:
            return opened, any(line.rstrip().endswith(target) for line in maps)
    except OSError:
        return opened, False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_a_file_cut_the_moment_a_plain_server_opens_it(tmp_path: Path) -> None:
    (tmp_path / "shipped").mkdir()
    models = tmp_path / "models"
    (models / "big").mkdir(parents=True)
    path = models / "big" / "model.gguf"
    _large_gguf(path)
    size = path.stat().st_size
    assert size > 64 * 2**20
    port = free_port()
    env = {"QKOV_SHIPPED_DIR": str(tmp_path / "shipped"), "QKOV_MODELS_DIR": str(models), "QKOV_STORE_URL": "off"}
    proc = start(["-c", PLAIN_SERVER, str(port)], port, env)
    base = f"http://127.0.0.1:{port}"
    try:
        answer: dict[str, Any] = {}

        def ask() -> None:
            try:
                answer["r"] = httpx.get(f"{base}/api/v1/models/big", timeout=120)
            except httpx.HTTPError as exc:  # the server died under the request
                answer["error"] = exc

        thread = threading.Thread(target=ask)
        thread.start()
        # The load and the checkpoint's digest (a plain read, on a thread of its own) open the file together: cut
        # it as soon as it is mapped, or MAP_WAIT_S after it was first opened when no reader maps it.
        deadline, opened_at = time.monotonic() + 60, None
        while True:
            opened, mapped = _held_by(proc.pid, path)
            now = time.monotonic()
            if mapped or (opened_at is not None and now - opened_at > MAP_WAIT_S):
                break
            if opened and opened_at is None:
                opened_at = now
            assert now < deadline and thread.is_alive(), "the server never opened the file"
        os.truncate(path, size // 4)
        thread.join(timeout=150)
        if "error" in answer:  # the connection was cut: give a dying server time to be reaped
            proc.wait(timeout=10)
        assert proc.poll() is None, f"the server died (exit {proc.poll()}; -7 is SIGBUS): {answer}"
        got = answer["r"]
        assert got.status_code == 422 and got.headers["content-type"].startswith("application/problem+json"), (
            got.status_code,
            got.text[:400],
        )
        assert "model.gguf" in got.json()["detail"] and str(models) not in got.json()["detail"]
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
    finally:
        proc.kill()
        proc.wait(timeout=30)
