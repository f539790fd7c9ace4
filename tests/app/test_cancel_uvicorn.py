"""Cancellation that works, on a real uvicorn on 127.0.0.1 with one compute slot.

For a long global top-k, a detector run and a path expansion, a client sends the request over a raw socket,
waits until the computation holds the slot and the engine loop has started, and disconnects. The middleware
notices the disconnect, sets the stop flag, the engine loop's check_stop raises CancelledError at its next
step, and the slot is free again: the test measures how long that takes from the disconnect (printed; the
bound asserted is a few seconds, against computations that take from seconds to minutes uninterrupted) and
checks through /metrics that the cancelled counter went up by one and no computation completed.

The model (written once per module): 8 layers x 8 heads, d_model 128, d_head 16, GPT-2's vocabulary of 50,257
tokens, random weights, no tokenizer (requests give token ids). Uninterrupted, on one thread: the global top-200
of a full OV circuit ~4 s, detectors on 32 x 400 tokens ~90 s, the order-3 expansion on 256 tokens ~2-4 s.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from safetensors.torch import save_file

from bench.server import free_port
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from tests.app.live_server import start

pytestmark = pytest.mark.xdist_group("uvicorn")
# 12 layers: the path expansion's order-3 terms (~L^3) keep it running for seconds, so that a test process
# descheduled for a moment under a full suite's load still disconnects before the computation could finish
SLOW = ModelConfig(
    n_layers=12,
    d_model=128,
    n_heads=8,
    d_head=16,
    d_vocab=50257,
    n_ctx=512,
    d_mlp=512,
    attn_only=False,
    act_fn="gelu",
    normalization_type="LN",
    positional_embedding_type="standard",
)
STOP_WITHIN_S = 5.0  # about 1 s is the aim; generous for a shared 2-core machine
TOKENS = ",".join(str((i * 7919) % 50257) for i in range(256))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("qkov-cancel")
    folder = root / "slow"
    folder.mkdir()
    model = random_model(SLOW, seed=0, dtype=torch.float32, std_embed=0.5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"format": "qkov", **SLOW.to_dict()}))
    port = free_port()
    env = {
        "QKOV_SHIPPED_DIR": str(root),
        "QKOV_COMPUTE_SLOTS": "1",
        "QKOV_SLOT_WAIT_S": "30",
        "QKOV_TORCH_THREADS": "1",
        "QKOV_PRELOAD": "true",
        "QKOV_STORE_URL": "off",
        "QKOV_INLINE_BUDGET_S": "100000",  # every request inline: this is the cancellation of a request's own work
    }
    proc = start(
        ["-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
        port,
        env,
        timeout_s=90,
    )
    base = f"http://127.0.0.1:{port}"
    yield base
    proc.kill()
    proc.wait(10)


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return float(next(x for x in text.splitlines() if x.startswith(name)).split()[-1])


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/models/slow/heads/L3H1/ov?k=200",  # global top-k over 50,257^2 entries, tile by tile
        "/api/v1/models/slow/detectors?seq_len=200&batch=32&heads=L0H0",  # chunked passes, polled at every hook
        f"/api/v1/models/slow/paths?max_order=3&tokens={TOKENS}",  # order by order, layer by layer
    ],
    ids=["global-top-k", "detectors", "path-expansion"],
)
def test_a_disconnect_stops_the_engine_loop_and_frees_the_slot(server: str, url: str) -> None:
    base = server
    port = int(base.rsplit(":", 1)[1])
    end = time.monotonic() + 120
    while metric(base, "qkov_compute_slots_in_use") > 0:  # whatever an earlier case left running has stopped
        assert time.monotonic() < end, "the slot never came free"
        time.sleep(0.05)
    cancelled, completed = metric(base, "qkov_compute_cancelled_total"), metric(base, "qkov_compute_completed_total")
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(f"GET {url} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        end = time.monotonic() + 30
        while metric(base, "qkov_compute_slots_in_use") < 1:
            assert time.monotonic() < end, "the request never took its slot"
            time.sleep(0.02)
        time.sleep(
            0.05
        )  # inside the computation (the shortest case, the path expansion, runs ~0.6 s on a quiet machine)
        left = time.monotonic()
    while metric(base, "qkov_compute_slots_in_use") > 0:
        assert time.monotonic() - left < STOP_WITHIN_S, (
            f"the slot was still held {STOP_WITHIN_S} s after the disconnect"
        )
        time.sleep(0.02)
    freed = time.monotonic() - left
    print(f"{url.split('?')[0]}: slot free {freed:.2f} s after the disconnect")
    assert metric(base, "qkov_compute_cancelled_total") == cancelled + 1
    assert metric(base, "qkov_compute_completed_total") == completed  # stopped, not finished
    assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
