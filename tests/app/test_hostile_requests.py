"""Hostile battery, part 2: requests and what a failed or changed folder does (9.2, 9.1's key).

- Token parameters that are not a valid id or a single token (`²`, `①`, `--1`, a 5,000-digit number, ...) are a
  422 problem+json on every API route that takes one, and never a 5xx on any page (routes found from the app).
- HEAD answers on every GET route (the GET's status and headers, no body), generated routes included.
- ETags are weak and 304s carry `Vary: Accept-Encoding`.
- X-Forwarded-For is believed only from configured proxies.
- A failed load is not retried until the folder's files change; a changed folder is loaded again.
- Two folders with the same weights but another tokenizer or token counts have different digests and never
  share an answer (a twin folder's direct path).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

import app.registry as registry_module
from app.main import create_app
from app.ratelimit import RateLimiter
from app.serving_middleware import client_address, proxy_networks
from app.settings import Settings
from circuits_core.prompt.phenomena import TOKEN_COUNTS_FILE
from tests.app.conftest import LIMITS, assert_problem, get_routes, train_tokenizer
from tests.bpe import train_bpe

# Hostile token values (non-ASCII digits and symbols, signs, ids out of range, hex and exponent forms, a NUL, several
# words, 5,000 characters); whether one is valid (an id in range, or a single token of the test tokenizer, e.g. "²" is
# the byte token 0xB2 there) is decided by `valid` below, independently of qkov.
BAD_TOKENS = [
    "²",
    "①",
    "--1",
    "9" * 5000,
    "-9" + "9" * 4999,
    "١٢٣",
    "-5",
    "99999999",
    "0x10",
    "1e3",
    "\x00",
    "a b c d e f g h",
    "x" * 5000,
    '""',
    "+-1",
    "٣",
    "𝟙",
]
BAD_ID_LISTS = ["1,²", "--1", "9" * 5000, "1,,①", "0x1", "-1", "1e3", "1;2", "99999999"]
TOKEN_PARAMS = ("token", "target", "contrast")
PATH_VALUES = {"model": "tiny-2l", "head": "L0H1", "source": "L0H1", "target": "L1H2"}


TOKENIZER = train_tokenizer()  # the tokenizer of the conftest models


def valid(token: str) -> bool:
    """The spec, computed with the tokenizers library: an ASCII id in the vocabulary, or one token's text or
    vocabulary entry."""
    if token.isascii() and token.isdigit():
        return len(token) < 10 and int(token) < TOKENIZER.get_vocab_size()
    text = token[1:-1] if len(token) >= 2 and token[0] == token[-1] == '"' else token
    single = len(TOKENIZER.encode(text, add_special_tokens=False).ids) == 1 or TOKENIZER.token_to_id(text) is not None
    return text != "" and len(text) <= 256 and single


def concrete(path: str) -> str:
    for name, value in PATH_VALUES.items():
        path = path.replace("{" + name + "}", value)
    return path


@pytest.fixture(scope="module")
def hclient(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def query_params(client: TestClient) -> dict[str, set[str]]:
    spec = client.get("/openapi.json").json()
    return {
        p: {q["name"] for q in op["get"].get("parameters", []) if q["in"] == "query"}
        for p, op in spec["paths"].items()
        if "get" in op
    }


def token_cases(client: TestClient) -> list[tuple[str, dict[str, str]]]:
    """(url, params) with one bad token parameter each, for every API route taking one."""
    cases = []
    for path, names in query_params(client).items():
        base = {"prompt": "the cat sat on the mat"} if "prompt" in names else {}
        if path.endswith("/path"):
            base["heads"] = "L0H1"
        for name in TOKEN_PARAMS:
            if name in names:
                cases += [(concrete(path), {**base, name: bad}) for bad in BAD_TOKENS]
        if "tokens" in names:
            cases += [(concrete(path), {"tokens": bad}) for bad in BAD_ID_LISTS]
    return cases


def test_the_bad_tokens_are_mostly_invalid_for_the_test_vocabulary() -> None:
    assert sum(not valid(t) for t in BAD_TOKENS) >= 14 and not valid("①") and not valid("--1") and not valid("9" * 5000)


def test_bad_tokens_are_422_problem_json_on_every_api_route(hclient: TestClient) -> None:
    cases = token_cases(hclient)
    routes_hit = {url for url, _ in cases}
    assert len(routes_hit) >= 8 and len(cases) >= 100  # the routes taking tokens were found
    failures = []
    for url, params in cases:
        answer = hclient.get(url, params=params)
        value = next(v for k, v in params.items() if k in (*TOKEN_PARAMS, "tokens"))
        if "tokens" in params or not valid(value):
            ok = answer.status_code == 422 and answer.headers["content-type"].startswith("application/problem+json")
        else:
            ok = answer.status_code in (200, 422)  # a valid token; 422 where another parameter does not fit
        if not ok:
            failures.append((url, {k: v[:20] for k, v in params.items()}, answer.status_code, answer.text[:200]))
    assert failures == []


@pytest.mark.parametrize("bad", ["①", "--1", "9" * 200, "9" * 5000, "-3"])
def test_bad_token_detail_says_what_was_expected(hclient: TestClient, bad: str) -> None:
    body = assert_problem(hclient.get("/api/v1/models/tiny-2l/direct", params={"token": bad}), 422)
    words = ("single token", "digits", "vocabulary", "at most")
    assert any(w in body["detail"] for w in words), body["detail"]
    assert len(body["detail"]) < 2000


def test_bad_tokens_never_give_5xx_on_pages(hclient: TestClient) -> None:
    """Every page, every token parameter name: never a 5xx (a page ignores a parameter it does not take); the
    token pages refuse with a 422 HTML page (full) or fragment (htmx)."""
    pages = [p for p, in_schema in get_routes(hclient.app) if p.startswith("/models/{model}")]  # type: ignore[arg-type]
    assert len(pages) >= 8
    failures, refused = [], set()
    for page in pages:
        for name in (*TOKEN_PARAMS, "tokens"):
            for bad in ("①", "--1", "9" * 5000):
                params = {"prompt": "the cat sat on the mat", name: bad}
                for headers in ({}, {"HX-Request": "true"}) if bad == "①" else ({},):
                    answer = hclient.get(concrete(page), params=params, headers=headers)
                    if answer.status_code >= 500 or answer.status_code not in (200, 422):
                        failures.append((page, name, bad[:10], answer.status_code))
                    if answer.status_code == 422:
                        assert answer.headers["content-type"].startswith("text/html")
                        refused.add(page)
    assert failures == []
    assert {"/models/{model}/direct", "/models/{model}/heads/{head}"} <= refused and len(refused) >= 4


def test_connection_survives_bad_tokens(hclient: TestClient) -> None:
    """A 500 must not reset the kept-alive connection: the same client keeps getting answers."""
    for bad in ("①", "9" * 5000, "--1"):
        assert hclient.get("/api/v1/models/tiny-2l/direct", params={"token": bad}).status_code == 422
        assert hclient.get("/healthz").status_code == 200


def test_head_on_every_get_route(hclient: TestClient) -> None:
    paths = [concrete(p) for p, _ in get_routes(hclient.app)]  # type: ignore[arg-type]
    paths += ["/static/charts.js", "/api/v1/models/nope", "/no/such/url"]
    assert len(paths) >= 30
    failures = []
    for path in paths:
        get = hclient.get(path, headers={"Accept-Encoding": "identity"})
        head = hclient.head(path, headers={"Accept-Encoding": "identity"})
        same = head.status_code == get.status_code and head.content == b""
        same = same and head.headers.get("content-type") == get.headers.get("content-type")
        if get.status_code == 200 and "content-length" in get.headers and path != "/metrics":  # metrics change
            same = same and head.headers.get("content-length") == str(len(get.content))
        if not same or head.status_code == 405:
            failures.append((path, get.status_code, head.status_code, len(head.content)))
    assert failures == []


def test_static_etags_are_weak_and_304s_vary_on_encoding(hclient: TestClient) -> None:
    url = "/static/charts.js"
    plain = hclient.get(url, headers={"Accept-Encoding": "identity"})
    zipped = hclient.get(url, headers={"Accept-Encoding": "gzip"})
    assert zipped.headers.get("content-encoding") == "gzip" and "content-encoding" not in plain.headers
    assert plain.headers["ETag"].startswith('W/"') and zipped.headers["ETag"].startswith('W/"')
    for tag in (plain.headers["ETag"], plain.headers["ETag"].removeprefix("W/")):
        again = hclient.get(url, headers={"If-None-Match": tag, "Accept-Encoding": "gzip"})
        assert again.status_code == 304 and "accept-encoding" in again.headers["Vary"].lower()


def test_etags_are_weak_and_304s_vary_on_encoding(hclient: TestClient) -> None:
    url = "/api/v1/models/tiny-2l/heads"
    plain = hclient.get(url, headers={"Accept-Encoding": "identity"})
    zipped = hclient.get(url, headers={"Accept-Encoding": "gzip"})
    assert plain.status_code == zipped.status_code == 200
    assert len(plain.content) >= 1024 and zipped.headers.get("content-encoding") == "gzip"  # two encodings of it
    for answer in (plain, zipped):
        assert answer.headers["ETag"].startswith('W/"'), answer.headers["ETag"]
        assert "accept-encoding" in answer.headers["Vary"].lower()
    not_modified = hclient.get(url, headers={"If-None-Match": plain.headers["ETag"], "Accept-Encoding": "gzip"})
    assert not_modified.status_code == 304 and not_modified.content == b""
    assert "accept-encoding" in not_modified.headers["Vary"].lower()


@pytest.mark.parametrize(
    ("peer", "forwarded", "trusted", "expected"),
    [
        ("203.0.113.9", "1.2.3.4", [], "203.0.113.9"),  # no proxy configured: the header is ignored
        ("127.0.0.1", "1.2.3.4", [], "127.0.0.1"),  # not even from a local client (no forged-header bypass)
        ("203.0.113.9", "1.2.3.4", ["10.0.0.0/8"], "203.0.113.9"),  # peer is not a trusted proxy
        ("10.0.0.1", "1.2.3.4", ["10.0.0.0/8"], "1.2.3.4"),
        ("10.0.0.1", "6.6.6.6, 1.2.3.4", ["10.0.0.0/8"], "1.2.3.4"),  # the client's own prefix is not believed
        ("10.0.0.1", "1.2.3.4, 10.0.0.7", ["10.0.0.0/8"], "1.2.3.4"),  # a chain of trusted proxies
        ("10.0.0.1", "10.0.0.3", ["10.0.0.0/8"], "10.0.0.1"),  # only proxies: the peer
        ("::1", "2001:db8::5", ["::1"], "2001:db8::5"),
    ],
)
def test_forwarded_address_believed_only_from_trusted_proxies(
    peer: str, forwarded: str, trusted: list[str], expected: str
) -> None:
    scope = {"client": (peer, 1234), "headers": [(b"x-forwarded-for", forwarded.encode())]}
    assert client_address(scope, proxy_networks(trusted)) == expected


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    with pytest.raises(ValueError, match="localhost"):
        Settings(trusted_proxies=["localhost"])
    assert Settings(trusted_proxies=["10.0.0.0/8", "::1"]).trusted_proxies == ["10.0.0.0/8", "::1"]


def test_rotating_forwarded_for_does_not_escape_the_rate_limit(settings: Settings) -> None:
    limited = settings.model_copy(update={"rate_limit": 3, "rate_window_s": 60.0})
    with TestClient(create_app(limited), client=("127.0.0.1", 5000)) as c:
        codes = [c.get("/api/v1/models", headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code for i in range(5)]
    assert codes == [200, 200, 200, 429, 429]
    proxied = settings.model_copy(update={"rate_limit": 3, "rate_window_s": 60.0, "trusted_proxies": ["127.0.0.1"]})
    with TestClient(create_app(proxied), client=("127.0.0.1", 5000)) as c:
        codes = [c.get("/api/v1/models", headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code for i in range(5)]
    assert codes == [200] * 5  # behind a configured proxy, each forwarded client has its own window


def test_the_per_client_table_stays_bounded() -> None:
    """The limiter's table stays bounded while forwarded addresses rotate: 5,000 clients, room for 100."""
    limiter = RateLimiter(limit=2, window_s=60, max_clients=100)
    for i in range(5000):
        limiter.hit(f"198.51.{i // 256}.{i % 256}")
    storage = vars(limiter._memory)
    assert max(len(storage["events"]), len(storage["locks"])) <= 100
    recent = "198.51.19.135"  # client 4999, remembered: its earlier hit counts
    assert [limiter.hit(recent)[0] for _ in range(2)] == [True, False]


@pytest.fixture()
def own_dirs(tmp_path: Path, model_dirs: tuple[Path, Path]) -> tuple[Path, Path]:
    shipped, models = tmp_path / "shipped", tmp_path / "models"
    shutil.copytree(model_dirs[0] / "tiny-2l", shipped / "tiny-2l")
    models.mkdir()
    return shipped, models


def test_a_failed_load_is_remembered_until_the_folder_changes(
    own_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped, models = own_dirs
    shutil.copytree(shipped / "tiny-2l", models / "flaky")
    config = json.loads((models / "flaky" / "config.json").read_text())
    (models / "flaky" / "config.json").write_text(json.dumps({**config, "n_layers": 100000}))
    calls: list[Path] = []
    real = registry_module.load_checkpoint

    def counting(folder: Path, **kwargs: Any) -> Any:
        calls.append(folder)
        return real(folder, **kwargs)

    monkeypatch.setattr(registry_module, "load_checkpoint", counting)
    with TestClient(create_app(Settings(shipped_dir=shipped, models_dir=models, limits=LIMITS))) as c:
        registry = c.app.state.registry  # type: ignore[attr-defined]
        assert not registry.settled(registry.entry("flaky"))  # never tried: a request would load it
        for _ in range(3):
            assert c.get("/api/v1/models").status_code == 200
            assert c.get("/readyz").status_code == 200
            assert_problem(c.get("/api/v1/models/flaky/heads"), 422, "n_layers")
        assert [p.name for p in calls].count("flaky") == 1  # tried once, remembered
        assert registry.settled(registry.entry("flaky"))  # the remembered failure answers without loading
        (models / "flaky" / "config.json").write_text(json.dumps(config))  # fixed: the files changed
        assert not registry.settled(registry.entry("flaky"))
        assert c.get("/api/v1/models/flaky/heads").status_code == 200
        assert [p.name for p in calls].count("flaky") == 2
        assert c.get("/api/v1/models/flaky/heads").status_code == 200
        assert [p.name for p in calls].count("flaky") == 2  # loaded and fresh: not loaded again
        assert registry.settled(registry.entry("flaky"))


def test_a_model_priced_over_the_limit_is_refused_before_loading(own_dirs: tuple[Path, Path]) -> None:
    shipped, models = own_dirs
    shutil.copytree(shipped / "tiny-2l", models / "big")
    settings = Settings(shipped_dir=shipped, models_dir=models, limits=LIMITS, max_model_bytes=2**20)
    with TestClient(create_app(settings)) as c:
        assert c.get("/api/v1/models/tiny-2l").status_code == 200  # shipped: small enough
        config = json.loads((models / "big" / "config.json").read_text())
        (models / "big" / "config.json").write_text(json.dumps({**config, "d_vocab": 10**6}))
        body = assert_problem(c.get("/api/v1/models/big"), 422, "over the limit", "d_vocab=1000000")
        assert str(models) not in body["detail"]


def test_same_weights_other_tokenizer_or_counts_never_share_answers(own_dirs: tuple[Path, Path]) -> None:
    """After twin/direct?token=5&k=2, toy/direct?token=5&k=2 answers as toy, not as the twin (same weights)."""
    shipped, models = own_dirs
    for name in ("toy", "twin", "counts"):
        shutil.copytree(shipped / "tiny-2l", models / name)
    other = train_bpe(["the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs\n"] * 20, 300)
    (models / "twin" / "tokenizer.json").write_text(other.to_str())
    counts = np.load(models / "counts" / TOKEN_COUNTS_FILE)
    np.save(models / "counts" / TOKEN_COUNTS_FILE, counts[::-1].copy())
    token = 290  # a merge: its text differs between the two tokenizers
    texts = {"toy": TOKENIZER.decode([token]), "twin": other.decode([token])}
    assert texts["toy"] != texts["twin"]
    with TestClient(create_app(Settings(shipped_dir=shipped, models_dir=models, limits=LIMITS))) as c:
        twin = c.get("/api/v1/models/twin/direct", params={"token": token, "k": 2})
        toy = c.get("/api/v1/models/toy/direct", params={"token": token, "k": 2})
        digests = {m: c.get(f"/api/v1/models/{m}").json()["digest"] for m in ("toy", "twin", "counts")}
        top_toy = c.get("/api/v1/models/toy/direct", params={"k": 3, "min_count": 500}).json()
        top_counts = c.get("/api/v1/models/counts/direct", params={"k": 3, "min_count": 500}).json()
    assert twin.status_code == toy.status_code == 200, (twin.text, toy.text)
    assert len(set(digests.values())) == 3
    assert (toy.json()["model"]["id"], toy.json()["model"]["digest"]) == ("toy", digests["toy"])
    assert (twin.json()["model"]["id"], twin.json()["model"]["digest"]) == ("twin", digests["twin"])
    assert toy.json()["token"]["text"] == texts["toy"] and twin.json()["token"]["text"] == texts["twin"]
    assert top_toy["model"]["id"] == "toy" and top_counts["model"]["id"] == "counts"
    assert top_toy["entries"] != top_counts["entries"]  # other counts, other frequent tokens


def test_request_time_errors_show_no_server_path(own_dirs: tuple[Path, Path]) -> None:
    """token_counts.npy is read per request: a broken one is a 422 naming the file, not the server's folder."""
    shipped, models = own_dirs
    shutil.copytree(shipped / "tiny-2l", models / "badcounts")
    np.save(models / "badcounts" / TOKEN_COUNTS_FILE, np.array([-1, 2, 3]))
    with TestClient(create_app(Settings(shipped_dir=shipped, models_dir=models, limits=LIMITS))) as c:
        body = assert_problem(c.get("/api/v1/models/badcounts/direct", params={"min_count": 1}), 422, TOKEN_COUNTS_FILE)
        page = c.get("/models/badcounts/direct", params={"min_count": 1})
    for text in (body["detail"], page.text):
        assert str(models) not in text and str(models.resolve()) not in text and "/tmp/" not in text


def test_fingerprint_follows_the_files(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("1")
    before = registry_module.fingerprint(tmp_path)
    assert registry_module.fingerprint(tmp_path) == before
    os.utime(tmp_path / "a", ns=(1, 1))
    assert registry_module.fingerprint(tmp_path) != before
    (tmp_path / "b").write_text("")
    assert len(registry_module.fingerprint(tmp_path)) == 2
