"""The rendered-page key: JSON of its parts, so no query value can make two URLs share a page (property tests over
generated parameters: independent pairs, and pairs whose strings concatenate to the same text split at another place,
which is where a key joining raw strings with any separator collides), and the shared-link poisoning case served
over a real disk store."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from app.main import create_app
from app.routers.page_cache import encode_page_key
from app.settings import Settings
from tests.app.conftest import LIMITS

ALPHABET = st.sampled_from('ab=&|,:;[]"\\ %\n')  # every separator a raw join might use
TEXT = st.text(alphabet=ALPHABET, max_size=6)
QUERY = st.lists(st.tuples(st.sampled_from(["prompt", "weighted", "heads", "a&b", "x=y"]), TEXT), max_size=4)
PARTS = st.tuples(TEXT, TEXT, QUERY, st.tuples(TEXT, TEXT), st.lists(TEXT, max_size=3))


def _normalised(parts):
    path, route, query, fragment, models = parts
    by_name: dict[str, list[str]] = {}
    for k, v in query:
        by_name.setdefault(k, []).append(v)
    return path, route, sorted(by_name.items()), fragment, tuple(models)


def _key(parts):
    path, route, query, fragment, models = parts
    return encode_page_key("digest", route, path, query, fragment, models)


@given(PARTS, PARTS)
def test_two_pages_share_a_key_only_when_their_normalised_parameters_are_equal(a, b):
    assert (_key(a) == _key(b)) == (_normalised(a) == _normalised(b))


def _fields(parts):
    """The strings of a page's parts, in order."""
    path, route, query, fragment, models = parts
    return [path, route, *[s for pair in query for s in pair], *fragment, *models]


def _rebuilt(parts, fields):
    """`parts` with its strings replaced by `fields` (same structure)."""
    path, route, query, fragment, models = parts
    it = iter(fields)
    return (next(it), next(it), [(next(it), next(it)) for _ in query], (next(it), next(it)), [next(it) for _ in models])


@st.composite
def resplit(draw):
    """(a, b): the same strings but for a piece that ends one of a's strings and starts the next of b's, so both
    concatenate to the same text: `'x|' + '|' + 'y'` and `'x' + '|' + '|y'` are one key if the parts are joined raw
    with '|' (or query pairs with '&' and '=')."""
    parts = draw(PARTS)
    fields = _fields(parts)
    i = draw(st.integers(0, len(fields) - 2))
    piece = draw(st.text(alphabet=ALPHABET, min_size=1, max_size=3))
    a, b = list(fields), list(fields)
    a[i] += piece
    b[i + 1] = piece + b[i + 1]
    return _rebuilt(parts, a), _rebuilt(parts, b)


@settings(max_examples=400)
@given(resplit())
def test_strings_split_at_another_place_never_share_a_key(pair):
    a, b = pair
    assert (_key(a) == _key(b)) == (_normalised(a) == _normalised(b))


@given(PARTS)
def test_parameter_order_across_names_does_not_change_the_key(a):
    path, route, query, fragment, models = a
    names = sorted({k for k, _ in query})
    reordered = [kv for name in reversed(names) for kv in query if kv[0] == name]
    assert _key(a) == _key((path, route, reordered, fragment, models))


def test_a_prompt_holding_a_query_string_does_not_poison_the_other_link(model_dirs: tuple[Path, Path], tmp_path: Path):
    """Opening prompt 'the cat sat&weighted=true' first must not make '?prompt=the cat sat&weighted=true' serve
    that page, in this process or in another one reading the same disk store."""
    shipped, user = model_dirs
    settings = Settings(
        shipped_dir=shipped, models_dir=user, dtype="float64", limits=LIMITS, store_url="disk", store_dir=tmp_path
    )
    poison = "/models/tiny-2l/prompt?prompt=the%20cat%20sat%26weighted%3Dtrue"
    honest = "/models/tiny-2l/prompt?prompt=the%20cat%20sat&weighted=true"
    with TestClient(create_app(settings)) as client:
        first = client.get(poison)
        assert first.status_code == 200
        second = client.get(honest)
        assert second.status_code == 200 and second.text != first.text
    with TestClient(create_app(settings)) as fresh:  # another process on the same store
        alone = fresh.get(honest).text
    assert alone == second.text != first.text
