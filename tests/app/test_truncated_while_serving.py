"""Weight files truncated while a real server reads them: a uvicorn on 127.0.0.1 whose every tensor read (safetensors)
and chunk read (GGUF) is slowed to 0.15 s (the server process wraps the two readers), so that the test truncates the
file in the middle of a load, or in the middle of the lazy read of a Llama checkpoint's MLP weights after the load.
Each time the request answers a problem+json 422 naming the file, the process stays alive and /healthz answers 200;
through a memory map the truncation was a SIGBUS that killed the server (the qkov/TransformerLens formats read their
safetensors through one until this branch). Folders: a tiny GGUF, a qkov checkpoint and a transformers-written
Llama checkpoint (its MLPs read on first use)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers

from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from tests.app.live_server import free_port, start
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
