"""Hostile pass over the rotary, residual-stream and copying endpoints: rotary QK at an offset, positional kernels,
band energies, composition at an offset and its delta profile, the residual-stream pages and API, attention
entropy, copying of every head, and the GGUF / Llama-family loaders.

One app (create_app over temp folders) serves a rotary GQA model with partial rotary dims, a 1-layer rotary model,
a 0-layer and a 1-layer shortformer model, and malformed GGUF files and Llama config.json folders. Every hostile
request must be answered with a 4xx problem+json (HTML for pages) whose detail names the fault -- never a 5xx --
and a second app with a 1 KiB working-memory budget must refuse every new endpoint by its price (priced before
it runs). Malformed checkpoints must be listed unavailable with a reason naming the field or tensor at fault.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.model.config import ModelConfig
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer
from tests.core.rotary_models import rotary_config
from tests.core.test_gguf import write_gguf

API = "/api/v1/models"


def gguf_with(**metadata: object) -> Callable[[Path], None]:
    """A tiny GGUF (test_gguf.write_gguf) whose writer calls add_<key>(value) with a hostile value instead."""

    def build(folder: Path) -> None:
        real = gguf.GGUFWriter

        class Hostile(real):  # type: ignore[misc, valid-type]
            pass

        for method, value in metadata.items():
            setattr(Hostile, method, lambda self, *_, _m=method, _v=value: getattr(real, _m)(self, _v))
        gguf.GGUFWriter = Hostile  # type: ignore[misc]
        try:
            write_gguf(folder / "m.gguf")
        finally:
            gguf.GGUFWriter = real  # type: ignore[misc]

    return build


def gguf_bytes(data: bytes) -> Callable[[Path], None]:
    return lambda folder: (folder / "m.gguf").write_bytes(data)


def gguf_cut(folder: Path) -> None:
    write_gguf(folder / "m.gguf")
    whole = (folder / "m.gguf").read_bytes()
    (folder / "m.gguf").write_bytes(whole[:-100])


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 61, "hidden_size": 16,
         "intermediate_size": 24, "num_hidden_layers": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-5,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 100.0}  # fmt: skip
EMPTY_SAFETENSORS = struct.pack("<Q", 2) + b"{}"


def llama(**changes: object) -> Callable[[Path], None]:
    def build(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
        (folder / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)

    return build


# folder -> (builder, a phrase the unavailable reason must contain)
BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "gguf-garbage": (gguf_bytes(b"hello world" * 10), "not a readable GGUF"),
    "gguf-magic-only": (gguf_bytes(b"GGUF"), "not a readable GGUF"),
    "gguf-huge-counts": (gguf_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62)), "not a readable GGUF"),
    "gguf-version-99": (gguf_bytes(b"GGUF" + struct.pack("<IQQ", 99, 0, 0)), "version 99"),
    "gguf-no-tensors": (gguf_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0)), "token_embd.weight"),
    "gguf-truncated": (gguf_cut, "not a readable GGUF"),
    "gguf-heads-0": (gguf_with(add_head_count=0), "head_count"),
    "gguf-heads-3": (gguf_with(add_head_count=3), "divisible"),
    "gguf-kv-heads-3": (gguf_with(add_head_count_kv=3), "n_key_value_heads"),
    "gguf-kv-heads-0": (gguf_with(add_head_count_kv=0), "n_key_value_heads"),
    "gguf-blocks-100000": (gguf_with(add_block_count=100000), "n_layers"),
    "gguf-blocks-3": (gguf_with(add_block_count=3), "blk.2"),
    "gguf-ctx-0": (gguf_with(add_context_length=0), "n_ctx"),
    "gguf-rope-dim-odd": (gguf_with(add_rope_dimension_count=5), "rotary_dim"),
    "gguf-rope-dim-over-head": (gguf_with(add_rope_dimension_count=64), "rotary_dim"),
    "gguf-rope-base-negative": (gguf_with(add_rope_freq_base=-1.0), "rotary_base"),
    "gguf-eps-negative": (gguf_with(add_layer_norm_rms_eps=-1.0), "eps"),
    "gguf-embd-huge": (gguf_with(add_embedding_length=2**20, add_feed_forward_length=2**20), "describes a model of"),
    "llama-kv-3": (llama(num_key_value_heads=3), "num_key_value_heads"),
    "llama-kv-0": (llama(num_key_value_heads=0), "num_key_value_heads"),
    "llama-head-dim-odd": (llama(head_dim=5), "rotary_dim"),
    "llama-rope-dynamic": (llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    "llama-rope-list": (llama(rope_scaling=[1]), "rope_scaling"),
    "llama3-incomplete": (llama(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    "llama-theta-negative": (llama(rope_theta=-5.0), "rope_theta"),
    "llama-linear-factor-0": (llama(rope_scaling={"rope_type": "linear", "factor": 0.0}), "factor"),
    "llama-layers-huge": (llama(num_hidden_layers=10**6), "n_layers"),
    "llama-vocab-huge": (llama(vocab_size=10**9), "over the limit"),
    "llama-act-unknown": (llama(hidden_act="relu6"), "relu6"),
    "llama-partial-rotary": (llama(partial_rotary_factor=0.3), "partial_rotary_factor"),
    "mistral-window-negative": (llama(model_type="mistral", sliding_window=-4), "sliding_window"),
    "llama-no-tensors": (llama(), "model.safetensors: missing tensor model.embed_tokens.weight"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hostile-new")
    tok = train_tokenizer()
    V = tok.get_vocab_size()
    rope = rotary_config(n_layers=2, d_vocab=V, n_ctx=64, n_key_value_heads=2, rotary_dim=6)
    save_qkov(root / "shipped" / "rope", rope, tok, seed=3)
    user = root / "user"
    save_qkov(user / "zero", ModelConfig(n_layers=0, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=32), tok, seed=4)
    save_qkov(user / "one", ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=32), tok, seed=5)
    rope1 = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=32,
                        positional_embedding_type="rotary", normalization_type="RMS")  # fmt: skip
    save_qkov(user / "rope1", rope1, tok, seed=6)
    for name, (build, _) in BROKEN.items():
        (user / name).mkdir()
        build(user / name)
    return root / "shipped", user


def _client(folders: tuple[Path, Path], **limits: int) -> Iterator[TestClient]:
    settings = Settings(shipped_dir=folders[0], models_dir=folders[1], dtype="float64", store_url="off",
                        limits=LIMITS.model_copy(update=limits), max_model_bytes=10**9)  # fmt: skip
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(folders: tuple[Path, Path]) -> Iterator[TestClient]:
    yield from _client(folders)


@pytest.fixture(scope="module")
def poor(folders: tuple[Path, Path]) -> Iterator[TestClient]:
    """The same models with 1 KiB of working memory per request: every computation is refused by its price."""
    yield from _client(folders, peak_bytes=1024, matrix_budget_bytes=1024)


def no_5xx(response: Any) -> None:
    """Any answer but a server error; a refusal is problem+json (API) or an HTML page saying why."""
    assert response.status_code < 500, (response.request.url, response.status_code, response.text[:300])
    if response.status_code >= 400 and response.request.url.path.startswith("/api/"):
        assert response.headers["content-type"].startswith("application/problem+json"), response.text[:300]
        assert response.json()["detail"]


HOSTILE_INTS = ["-1", "0", "1", "63", "64", "65", "4096", "4097", "99999999999999999999", "1e3", "nan", "", "abc"]
ENDPOINTS = {  # path under /api/v1/models/{model}/ -> its query parameters
    "heads/L0H1/qk": ["offset", "k", "token", "side"],
    "heads/L0H1/skip-trigrams": ["offset", "k"],
    "heads/L0H1/positional": ["max_offset"],
    "heads/L0H1/bands": [],
    "composition": ["offset", "kind"],
    "composition/L0H0/L1H1/profile": ["max_offset", "kind"],
    "attention-entropy": ["prompt", "tokens"],
    "copying": ["k", "min_count", "samples"],
    "residual": ["offset"],
    "residual/usage": ["energy", "offset"],
    "residual/L0H0/unembed": ["offset", "k", "n_top"],
}


@pytest.mark.parametrize("model", ["rope", "zero", "one", "rope1", "nope", "gguf-heads-3"])
@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_hostile_values_never_get_a_server_error(client: TestClient, model: str, path: str) -> None:
    url = f"{API}/{model}/{path}"
    no_5xx(client.get(url))
    for name in ENDPOINTS[path]:
        for value in HOSTILE_INTS + (["Q", "K", "V", "q"] if name == "kind" else []):
            no_5xx(client.get(url, params={name: value}))
            if name in ("offset", "max_offset"):
                no_5xx(client.get(url, params={name: value, "kind": "Q"}))
                no_5xx(client.get(url, params={name: value, "kind": "V"}))


@pytest.mark.parametrize("head", ["L9H0", "L0H9", "L-1H0", "x", "L0H0.5", "L1H-1", "L" + "9" * 400 + "H0"])
@pytest.mark.parametrize("path", ["heads/{h}/qk", "heads/{h}/positional", "heads/{h}/bands",
                                  "composition/{h}/L1H1/profile", "composition/L0H0/{h}/profile",
                                  "residual/{h}/unembed", "residual/embed/{h}.Q"])  # fmt: skip
def test_bad_heads_are_refused_by_name(client: TestClient, head: str, path: str) -> None:
    answer = client.get(f"{API}/rope/{path.format(h=head)}")
    assert answer.status_code in (404, 422), answer.text
    assert_problem(answer, answer.status_code)


# (path, params, status, phrases the detail must contain)
REFUSALS = [
    ("one/heads/L0H0/qk", {"offset": 3}, 422, ["rotary"]),
    ("one/heads/L0H0/skip-trigrams", {"offset": 3}, 422, ["rotary"]),
    ("one/heads/L0H0/positional", {}, 422, ["rotary"]),
    ("one/heads/L0H0/bands", {}, 422, ["rotary"]),
    ("one/composition", {"kind": "K", "offset": 2}, 422, ["2 layers"]),
    ("zero/composition", {"kind": "Q"}, 422, ["2 layers"]),
    ("rope1/composition", {"kind": "Q", "offset": 1}, 422, ["2 layers"]),
    ("rope/heads/L0H0/qk", {"offset": 64}, 422, ["n_ctx = 64", "64"]),
    ("rope/heads/L0H0/qk", {"offset": -1}, 422, ["offset"]),
    ("rope/heads/L0H0/skip-trigrams", {"offset": 10**6}, 422, ["n_ctx"]),
    ("rope/composition", {"kind": "K", "offset": 64}, 422, ["n_ctx"]),
    ("rope/composition", {"kind": "V", "offset": 2}, 422, ["V-composition", "offset"]),
    ("rope/composition/L1H0/L0H1/profile", {}, 422, ["earlier layer"]),
    ("rope/composition/L0H0/L0H1/profile", {}, 422, ["earlier layer"]),
    ("rope/composition/L0H0/L1H1/profile", {"kind": "V"}, 422, ["kind"]),
    ("rope/heads/L0H0/positional", {"max_offset": 4097}, 422, ["max_offset", "4096"]),
    ("rope/heads/L0H0/positional", {"max_offset": 0}, 422, ["max_offset"]),
    ("rope/residual/L1H0/L0H0", {}, 422, ["reader", "L<l>H<h>.Q|K|V"]),
    ("rope/residual/unembed/embed", {}, 422, ["writer"]),
    ("rope/residual/L0H0/unembed", {"k": 0}, 422, ["k"]),
    ("rope/residual/L0H0/unembed", {"k": 10**6}, 422, ["k"]),
    ("one/residual", {"offset": 9}, 422, ["rotary"]),
    ("rope/residual", {"offset": 64}, 422, ["n_ctx"]),
    ("rope/residual/L0H0/L1H1.Q", {"offset": 10**6}, 422, ["n_ctx"]),
    ("rope/residual/usage", {"offset": 64}, 422, ["n_ctx"]),
    ("rope/residual/usage", {"energy": 1.5}, 422, ["energy"]),
    ("rope/residual/usage", {"energy": 0}, 422, ["energy"]),
    ("rope/attention-entropy", {"tokens": "1,2,99999"}, 422, ["99999", "vocabulary"]),
    ("rope/attention-entropy", {"prompt": ""}, 422, ["empty"]),
    ("rope/attention-entropy", {"prompt": "the cat " * 200}, 422, []),
    ("rope/copying", {"samples": 0}, 422, ["samples"]),
    ("rope/copying", {"min_count": 5}, 422, ["token counts"]),
    ("zero/copying", {}, 422, []),
    ("zero/heads/L0H0/positional", {}, 404, ["0 layers"]),
]


@pytest.mark.parametrize(("path", "params", "status", "needles"), REFUSALS, ids=[f"{p}-{q}" for p, q, _, _ in REFUSALS])
def test_each_refusal_names_the_fault(client: TestClient, path: str, params: dict[str, object], status: int,
                                      needles: list[str]) -> None:  # fmt: skip
    assert_problem(client.get(f"{API}/{path}", params=params), status, *needles)


PAGES = ["", "/heads/L0H0", "/heads/L0H0?offset=5", "/heads/L0H0?offset=-3", "/heads/L0H0?offset=99999",
         "/heads/L9H0?offset=1", "/composition?kind=Q&offset=3", "/composition?kind=K&offset=999",
         "/composition?kind=V&offset=2", "/composition/L0H0/L1H1?kind=K", "/composition/L0H0/L1H1?offset=7&kind=Q",
         "/composition/L1H1/L0H0?kind=Q", "/residual", "/residual?offset=9", "/residual?offset=-9",
         "/residual/L0H0/unembed", "/residual/embed/L1H0", "/residual/usage?energy=2", "/copying",
         "/copying?samples=1", "/attention-entropy?prompt=hi", "/attention-entropy?tokens=1,2,99999"]  # fmt: skip


@pytest.mark.parametrize("model", ["rope", "zero", "one", "rope1"])
def test_new_pages_never_get_a_server_error(client: TestClient, model: str) -> None:
    for page in PAGES:
        answer = client.get(f"/models/{model}{page}")
        assert answer.status_code < 500, (page, answer.status_code, answer.text[:300])
        assert answer.headers["content-type"].startswith("text/html"), page


HX = [{"HX-Request": "true"}, {"HX-Request": "true", "HX-Target": "main"}]


@pytest.mark.parametrize("model", ["rope", "zero", "one", "rope1"])
def test_new_page_fragments_never_get_a_server_error(client: TestClient, model: str) -> None:
    """The same pages asked by htmx (a fragment: the page's block rendered alone)."""
    for page in PAGES:
        for headers in HX:
            answer = client.get(f"/models/{model}{page}", headers=headers)
            assert answer.status_code < 500, (page, headers, answer.status_code, answer.text[:300])


@pytest.mark.parametrize("page", ["/models/rope/residual/L0H0/unembed", "/models/one/residual/embed/L0H0.V"])
def test_the_virtual_weight_page_renders_as_an_htmx_fragment(client: TestClient, page: str) -> None:
    for headers in HX:
        assert client.get(page, headers=headers).status_code == 200


def test_rotary_pages_on_a_shortformer_model_say_why(client: TestClient) -> None:
    answer = client.get("/models/one/heads/L0H0?offset=5")
    assert answer.status_code == 422 and "rotary models only" in answer.text


PRICED = ["heads/L0H0/qk?offset=3", "heads/L0H0/skip-trigrams?offset=2", "heads/L0H0/positional", "heads/L0H0/bands",
          "composition?kind=Q&offset=2", "composition?kind=K", "composition/L0H0/L1H1/profile?kind=K",
          "attention-entropy?prompt=hello%20there", "copying", "heads/L0H0/copying", "residual", "residual/usage",
          "residual/L0H0/unembed", "heads/L0H0/ov?basis=raw"]  # fmt: skip


@pytest.mark.parametrize("path", PRICED)
def test_every_new_endpoint_is_priced_before_it_runs(poor: TestClient, path: str) -> None:
    body = assert_problem(poor.get(f"{API}/rope/{path}"), 422, "peak_bytes")
    assert body["type"].endswith("limit-exceeded")


@pytest.mark.parametrize("path", ["heads/L0H0/positional", "heads/L0H0/bands", "heads/L0H0/qk?offset=3"])
def test_a_rotary_request_on_a_shortformer_model_is_refused_for_its_positions_not_its_price(
    poor: TestClient, path: str
) -> None:
    assert_problem(poor.get(f"{API}/one/{path}"), 422, "rotary")


def test_a_value_reader_at_an_offset_is_refused(client: TestClient) -> None:
    assert_problem(client.get(f"{API}/rope/residual/L0H0/L1H1.V", params={"offset": 3}), 422, "only Q and K readers")
    assert client.get(f"{API}/rope/residual/L0H0/L1H1.K", params={"offset": 3}).status_code == 200


def test_malformed_checkpoints_are_listed_unavailable_naming_the_fault(client: TestClient) -> None:
    listed = {m["id"] for m in client.get(API).json()}
    assert listed == {"rope", "zero", "one", "rope1"}
    reasons = {u["id"]: u["detail"] for u in client.get("/api/v1/unavailable-models").json()}
    assert set(reasons) == set(BROKEN)
    for name, (_, needle) in BROKEN.items():
        assert needle.lower() in reasons[name].lower(), (name, reasons[name])
        assert "/tmp" not in reasons[name], (name, reasons[name])


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_malformed_checkpoint_answers_422_on_the_new_endpoints(client: TestClient, name: str) -> None:
    for path in ("heads/L0H0/positional", "composition/L0H0/L1H1/profile", "residual", "attention-entropy?prompt=a"):
        assert_problem(client.get(f"{API}/{name}/{path}"), 422, BROKEN[name][1])
    page = client.get(f"/models/{name}/residual")
    assert page.status_code == 422 and page.headers["content-type"].startswith("text/html")


@pytest.mark.parametrize("chapter", ["smollm2", "paper", "", "SMOLLM2", "x" * 10000, "../etc", "smollm2\x00"])
def test_tour_chapters_never_get_a_server_error(client: TestClient, chapter: str) -> None:
    no_5xx(client.get("/api/v1/tour", params={"chapter": chapter}))
    page = client.get("/tour", params={"chapter": chapter})
    assert page.status_code < 500 and page.headers["content-type"].startswith("text/html"), page.status_code
    if chapter == "smollm2":  # SmolLM2 is not among this app's models: each figure says how to get it
        figures = client.get("/api/v1/tour", params={"chapter": chapter}).json()["figures"]
        assert figures and all(not f["available"] and "make smollm2" in f["detail"] for f in figures)
