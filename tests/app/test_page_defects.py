"""Page defects of a researcher's pass on a real model, each against the behaviour it replaces: token-id links
no longer put "None" in the prompt box (and Show then analysed the text "None"), a text target says which token
it resolved to and offers the other spelling ('name' vs ' name'), head pages highlight no sidebar item (they
highlighted "Overview")."""

from __future__ import annotations

import html as htmllib
import re

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
