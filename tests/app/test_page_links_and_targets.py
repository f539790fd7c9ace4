"""The links and targets of the pages, each against the behaviour it replaces: token-id links do not put "None"
in the prompt box (and Show then analyse the text "None"), a text target says which token it resolved to and offers
the other spelling ('name' vs ' name'), head pages highlight no sidebar item (they highlighted "Overview"), the QK
path page lists the terms of one score, a pair page reads its directions in tokens, JSON links carry the params."""

from __future__ import annotations

import html as htmllib
import re

import pytest
from fastapi.testclient import TestClient

from tests.app.conftest import train_tokenizer

API = "/api/v1/models/tiny-2l"
IDS = "5,17,40,5,17"


def _box(page: str) -> str:
    return htmllib.unescape(re.search(r'<textarea name="prompt"[^>]*>(.*?)</textarea>', page, re.S).group(1)).strip()


def _form_fields(page: str) -> dict[str, str]:
    """What the prompt box's form submits: the box's text and the hidden fields beside it."""
    form = re.search(r'<form[^>]*>(?:(?!</form>).)*<textarea name="prompt".*?</form>', page, re.S).group(0)
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form))
    fields["prompt"] = _box(page)
    return {k: htmllib.unescape(v) for k, v in fields.items()}


def test_token_id_links_keep_their_ids_through_show(client: TestClient) -> None:
    for page_path, extra in (("/prompt", {}), ("/qk-paths", {"head": "L1H0"}), ("/path", {"heads": "L0H1,L1H0"})):
        page = client.get(f"/models/tiny-2l{page_path}", params={"tokens": IDS, **extra})
        assert page.status_code == 200, page_path
        assert _box(page.text) == "" and "None" not in _box(page.text), page_path
        sent = _form_fields(page.text)
        assert sent["tokens"] == IDS, page_path
        again = client.get(f"/models/tiny-2l{page_path}", params={**extra, **sent})  # pressing Show unchanged
        assert again.status_code == 200 and 'id="token-ids-note"' in again.text, page_path
    # what Show analyses: the ids, not the text "None"
    sent = _form_fields(client.get("/models/tiny-2l/prompt", params={"tokens": IDS}).text)
    page = client.get("/models/tiny-2l/prompt", params=sent)
    ids = [int(i) for i in re.findall(r'title="token (\d+) at position \d+"', page.text)]
    assert ids == [int(i) for i in IDS.split(",")]
    # text typed in the box replaces the ids
    typed = client.get("/models/tiny-2l/prompt", params={**sent, "prompt": "the cat sat"})
    want = [int(i) for i in train_tokenizer().encode("the cat sat").ids]
    got = [int(i) for i in re.findall(r'title="token (\d+) at position \d+"', typed.text)]
    assert got[-len(want) :] == want and 'id="token-ids-note"' not in typed.text


def test_text_target_says_which_token_and_offers_the_other(client: TestClient) -> None:
    vocab = train_tokenizer().get_vocab()
    bare, spaced = vocab["name"], vocab["Ġname"]
    page = client.get("/models/tiny-2l/prompt", params={"prompt": "self.name = name", "target": "name"}).text
    note = re.search(r'id="target-spelling">(.*?)</p>', page, re.S).group(1)
    assert f"(id {bare})" in note and f"(id {spaced}) is a different token" in note
    assert "target=+name" in note or "target=%20name" in note
    paths = client.get(f"{API}/paths", params={"prompt": "self.name = name", "target": "name"}).json()
    assert paths["target_token"]["id"] == bare  # the note names the token the expansion used
    spaced_page = client.get("/models/tiny-2l/prompt", params={"prompt": "self.name = name", "target": " name"}).text
    assert f"(id {spaced}), exactly as typed" in spaced_page and f"(id {bare}) is a different token" in spaced_page
    by_id = client.get("/models/tiny-2l/prompt", params={"prompt": "self.name = name", "target": str(bare)}).text
    assert 'id="target-spelling"' not in by_id  # an id is unambiguous


def test_head_pages_highlight_no_sidebar_item(client: TestClient) -> None:
    head = client.get("/models/tiny-2l/heads/L1H0").text
    assert 'class="item active"' not in head
    overview = client.get("/models/tiny-2l").text
    assert re.search(r'class="item active" href="[^"]*">Overview<', overview)
    composition = client.get("/models/tiny-2l/composition").text
    assert re.search(r'class="item active" href="[^"]*">Composition<', composition)


def test_qk_paths_lists_the_terms_of_one_score(client: TestClient) -> None:
    """The QK paths page splits the score at (query, key) into its terms (the tour's R3 sentence names them):
    with every term listed they add up to the real score, which a plain forward pass gives."""
    import torch

    from circuits_core.formats.checkpoint import load_checkpoint
    from tests.app.conftest import LIMITS  # noqa: F401  (the client's limits: k up to 50)

    prompt = "the cat sat on the mat"
    body = client.get(
        f"{API}/qk-paths", params={"prompt": prompt, "head": "L1H2", "query": 5, "key": 2, "k": 50}
    ).json()
    at = body["at"]
    C = len(body["components"])
    assert len(at["terms"]) == min(50, C * C)
    if C * C <= 50:
        assert sum(t["value"] for t in at["terms"]) == pytest.approx(at["score"], abs=1e-9)
    ids = [t["id"] for t in body["tokens"]]
    folder = client.app.state.registry.entry("tiny-2l").path  # the served checkpoint, read again
    model = load_checkpoint(folder, dtype=torch.float64).model
    _, cache = model.run(torch.tensor([ids]), names=lambda n: n.endswith(("hook_attn_scores", "hook_pattern")))
    assert at["score"] == pytest.approx(float(cache["blocks.1.attn.hook_attn_scores"][0, 2, 5, 2]), abs=1e-9)
    assert at["attention"] == pytest.approx(float(cache["blocks.1.attn.hook_pattern"][0, 2, 5, 2]), abs=1e-9)
    values = [abs(t["value"]) for t in at["terms"]]
    assert values == sorted(values, reverse=True)
    page = client.get("/models/tiny-2l/qk-paths", params={"prompt": prompt, "head": "L1H2", "query": 5, "key": 2})
    assert f'id="at-score">{at["score"]:.2f}<' in page.text and 'id="score-terms-table"' in page.text
    for bad in ({"query": 2, "key": 5}, {"query": 5}, {"query": 99, "key": 0}):
        r = client.get(f"{API}/qk-paths", params={"prompt": prompt, "head": "L1H2", **bad})
        assert r.status_code == 422, bad


def test_head_to_head_pair_page_reads_its_directions_in_tokens(client: TestClient) -> None:
    """A head -> head pair listed 'd_model directions' where tokens belong; now each side shows the tokens of its
    reading (through W_E, and W_U for a value output), the JSON twin's entries."""
    page = client.get("/models/tiny-2l/residual/L0H1/L1H2.V").text
    assert "d_model directions" not in page and "read through W_E" in page and "read through W_U" in page
    body = client.get(f"{API}/residual/L0H1/L1H2.V").json()
    assert body["input_read"] == "W_E" and body["output_read"] == "W_U"
    first = body["directions"][0]
    shown = re.findall(r'title="token (\d+)"', page.split('id="directions-table"', 1)[1].split("</tr>", 2)[1])
    want = [e["token"]["id"] for e in first["input_tokens_top"]]
    assert [int(t) for t in shown[: len(want)]] == want


@pytest.mark.parametrize(
    ("path", "query", "route"),
    [
        ("/models/tiny-ln/residual/usage", {"basis": "raw", "writers_from": "1"}, "/residual/usage"),
        ("/models/tiny-2l/heads/L1H2", {"token": "5", "k": "4", "basis": "raw"}, "/heads/L1H2/skip-trigrams"),
    ],
)
def test_json_links_carry_the_page_params(client: TestClient, path: str, query: dict[str, str], route: str) -> None:
    """Every link to the panel's JSON answers the same request as the panel: the residual usage panel's link kept only
    `energy` (a raw-basis page linked the served weights' answer, a later page of writers the first)."""
    page = client.get(path, params=query).text
    links = [htmllib.unescape(h) for h in re.findall(r'href="(/api/v1/models/[^"]+)"', page)]
    mine = [h for h in links if h.split("?")[0].endswith(route)]
    assert mine
    for link in mine:
        assert all(f"{key}={value}" in link for key, value in query.items()), link
