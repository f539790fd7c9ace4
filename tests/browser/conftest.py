"""Browser-test fixtures: a real uvicorn server on 127.0.0.1 (free port, in a thread) serving tiny random
models, and Debian's chromium driven by Playwright (`playwright install` cannot download browsers here).

`shipped_server` serves the real shipped checkpoints (toy-0l, toy-1l, toy-2l) for the screenshot pass. Every
page opened through the `page` (or `shipped_page`) fixture records each request; at teardown the test fails if
any URL left localhost or a JavaScript error was thrown. Screenshots go to artifacts/screenshots/ (gitignored).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import uvicorn

from app.main import create_app
from app.settings import Limits, Settings
from circuits_core.model.config import ModelConfig
from tests.app.conftest import save_qkov, train_tokenizer

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
SCREENSHOTS = ARTIFACTS / "screenshots"
SHIPPED = ARTIFACTS.parent / "checkpoints"
VIEWPORT = {"width": 1280, "height": 800}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every browser test shares one server and one browser: one xdist worker (--dist loadgroup)."""
    for item in items:
        if "tests/browser/" in str(item.fspath):
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.xdist_group("browser"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(settings: Settings) -> Iterator[str]:
    """Base URL of a live uvicorn server (in a thread) on `settings`; stops at the end."""
    app = create_app(settings)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


def serve_model(
    tmp_path_factory: pytest.TempPathFactory, name: str, cfg: ModelConfig, seed: int, limits: Limits
) -> Iterator[str]:
    """A live server on one random model `name` of shape `cfg` (qkov format, the test tokenizer), float32, no store."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need {CHROMIUM} (make browser-deps)")
    root = tmp_path_factory.mktemp(f"browser-{name}")
    save_qkov(root / name, cfg, train_tokenizer(), seed=seed)
    yield from serve(Settings(shipped_dir=root, dtype="float32", limits=limits, store_url="off"))


@pytest.fixture(scope="session")
def shipped_server() -> Iterator[str]:
    """A live server on the real shipped checkpoints (default settings), for the screenshot pass."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need {CHROMIUM} (make browser-deps)")
    if not (SHIPPED / "toy-2l").exists():
        pytest.skip("the shipped checkpoints are not in this tree")
    yield from serve(Settings(shipped_dir=SHIPPED))


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a live server on tiny random models named like the shipped ones (so the paper tour has
    figures): toy-2l (2 layers x 4 heads), toy-1l (1 x 2) and toy-0l (no layers)."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need {CHROMIUM} (make browser-deps)")
    root = tmp_path_factory.mktemp("browser-models")
    tok = train_tokenizer()
    V = tok.get_vocab_size()
    save_qkov(
        root / "toy-2l",
        ModelConfig(
            n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=V, n_ctx=64, positional_embedding_type="shortformer"
        ),
        tok,
        seed=1,
    )
    save_qkov(
        root / "toy-1l",
        ModelConfig(
            n_layers=1, d_model=32, n_heads=2, d_head=8, d_vocab=V, n_ctx=64, positional_embedding_type="standard"
        ),
        tok,
        seed=2,
    )
    save_qkov(
        root / "toy-0l",
        ModelConfig(
            n_layers=0, d_model=32, n_heads=2, d_head=8, d_vocab=V, n_ctx=64, positional_embedding_type="standard"
        ),
        tok,
        seed=3,
    )
    limits = Limits(
        max_prompt_tokens=64, max_k=50, max_heads=4, max_batch=8, max_seq_len=30, matrix_budget_bytes=16 * 2**20
    )
    yield from serve(Settings(shipped_dir=root, dtype="float32", limits=limits))


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server: str) -> Iterator[object]:  # noqa: ANN001
    """A fresh context (empty cache) at 1280x800; asserts at teardown that no request left 127.0.0.1."""
    yield from checked_page(browser, server)


@pytest.fixture
def shipped_page(browser, shipped_server: str) -> Iterator[object]:  # noqa: ANN001
    """The same on the server of the real shipped models."""
    yield from checked_page(browser, shipped_server)


def checked_page(browser, base_url: str) -> Iterator[object]:  # noqa: ANN001
    context = browser.new_context(viewport=VIEWPORT, base_url=base_url)
    pg = context.new_page()
    urls: list[str] = []
    errors: list[str] = []
    pg.on("request", lambda req: urls.append(req.url))
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.set_default_timeout(15000)
    yield pg
    context.close()
    outside = [u for u in urls if urlsplit(u).scheme not in ("data", "blob") and urlsplit(u).hostname != "127.0.0.1"]
    assert not outside, f"requests left localhost: {outside}"
    assert not errors, f"JavaScript errors: {errors}"


def screenshot(pg, name: str) -> Path:  # noqa: ANN001
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    pg.screenshot(path=str(path), full_page=False)
    return path
