"""The rankings answers give, with exact ties planted, against a brute-force Python sort of the same float64 values,
whichever way the backend orders equal values (tests/another_backend.py; docs/maths.md §1.7): ranking.top_k itself
(by value, equal values by index, the lower first, at the k-th value too; torch.topk fails it on either backend),
path terms, skip-trigrams, and a virtual weight's directions (their sign, §1.8, and their extreme tokens)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from circuits_core.circuits import residual_stream
from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import virtual_weights as vw
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.head_circuits import full_ov_row, full_qk_col
from circuits_core.circuits.skip_trigrams import skip_trigrams
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, random_model
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.virtual import rank_by_v_composition
from circuits_core.ranking import by_value_then_indices, top_k
from tests.another_backend import AnotherBackend


def brute_force(row: list[float], k: int, largest: bool) -> list[tuple[float, int]]:
    """(value, index) of the k first in the stated order: by value, then by index."""
    ranked = sorted(range(len(row)), key=lambda i: (-row[i] if largest else row[i], i))[:k]
    return [(row[i], i) for i in ranked]


def planted_ties(rows: int, n: int, seed: int) -> torch.Tensor:
    """[rows, n] float64 drawn from 5 values: every row is mostly ties, across every k-th value."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.tensor([-1.5, 0.0, 0.25, 2.0, 7.0], dtype=torch.float64)
    return levels[torch.randint(0, 5, (rows, n), generator=g)]


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("another_backend", [False, True])
def test_top_k_is_the_brute_force_order_whatever_the_backends_tie_order(largest: bool, another_backend: bool) -> None:
    for r, row in enumerate(planted_ties(6, 40, seed=0)):
        for k in (0, 1, 3, 8, 17, 40):
            with AnotherBackend() if another_backend else contextlib.nullcontext() as mode:
                got_v, got_i = top_k(row, k, largest)
            assert mode is None or mode.calls > 0
            got = list(zip(got_v.tolist(), got_i.tolist(), strict=True))
            assert got == brute_force(row.tolist(), k, largest), (k, r)


# -- the rankings answers give ------------------------------------------------------------------------------------
def tiny_model(**fields: Any) -> Transformer:
    cfg = dict(n_layers=2, d_model=16, n_heads=2, d_head=4, d_vocab=40, n_ctx=10, attn_only=True) | fields
    return random_model(ModelConfig(**cfg), seed=0, dtype=torch.float64)


def test_path_terms_of_equal_size_rank_in_the_expansions_order() -> None:
    """Without biases, the bias terms (and every path from them) are exactly 0: they rank after the others, in the
    expansion's own order, on either backend (the first GPU check listed two of them swapped)."""
    model = tiny_model(normalization_type="LN", positional_embedding_type="standard")
    exp = expand_logits(model, torch.tensor([1, 5, 7, 2, 5]), target=3, max_order=2, by_source=False)
    values = exp.values[:, 0].tolist()  # [T] float64
    assert values.count(0.0) >= 3  # the planted ties
    expected = sorted(range(len(values)), key=lambda i: (-abs(values[i]), i))
    with AnotherBackend() as mode:
        assert exp.ranked(0).tolist() == expected
        assert [t.path for t in exp.top(len(values))] == [exp.paths[i] for i in expected]
    assert mode.calls


def planted_twins(model: Transformer, pairs: list[tuple[int, int]], embed: bool, unembed: bool) -> None:
    """Token b gets token a's embedding row and/or unembedding column, for each (a, b): exact ties wherever a token
    side is read."""
    with torch.no_grad():
        for a, b in pairs:
            if embed:
                model.embed.W_E[b] = model.embed.W_E[a]
            if unembed:
                model.unembed.W_U[:, b] = model.unembed.W_U[:, a]


def by_value_then_index(values: list[float], k: int, largest: bool = True) -> list[int]:
    return sorted(range(len(values)), key=lambda i: (-values[i] if largest else values[i], i))[:k]


def test_skip_trigrams_rank_twin_tokens_by_id() -> None:
    """Destinations (a QK column) and outs (an OV row) with twins among the top: by score, then token id; the
    trigrams by joint, then destination, then out; against a brute-force sort of the same columns."""
    model = tiny_model()
    source, k = 3, 6
    col, row = full_qk_col(model, 1, 0, source), full_ov_row(model, 1, 0, source)
    top_dest, top_out = int(col.argmax()), int(row.argmax())
    twins = [(top_dest, b) for b in (0, 39, 17) if b != top_dest] + [(top_out, b) for b in (1, 38) if b != top_out]
    planted_twins(model, twins[:2], embed=True, unembed=False)
    planted_twins(model, twins[2:], embed=False, unembed=True)
    col, row = full_qk_col(model, 1, 0, source).tolist(), full_ov_row(model, 1, 0, source).tolist()
    assert col.count(max(col)) >= 3 and row.count(max(row)) >= 3  # the planted ties (exact)
    dest, out = by_value_then_index(col, k), by_value_then_index(row, k)
    joint = {(b, c): col[b] * row[c] for b in dest for c in out}
    rank = {b: i for i, b in enumerate(dest)} | {("out", c): i for i, c in enumerate(out)}
    triples = sorted(joint, key=lambda bc: (-joint[bc], rank[bc[0]], rank[("out", bc[1])]))
    with AnotherBackend() as mode:
        st = skip_trigrams(model, 1, 0, source, k)
    assert mode.calls
    assert st.dest_tokens.tolist() == dest and st.out_tokens.tolist() == out
    assert [(b, c) for b, c, _ in st.triples] == triples


def signed_by_largest_entry(u: list[float]) -> list[float]:
    """u times the sign of its entry of largest magnitude (the first of equal magnitudes)."""
    j = max(range(len(u)), key=lambda i: (abs(u[i]), -i))
    return [x if u[j] > 0 else -x for x in u]


def test_virtual_weight_directions_have_one_sign_and_twin_tokens_rank_by_id() -> None:
    """The embedding -> unembedding virtual weight, with twin tokens on both sides: each direction's input side has
    its entry of largest magnitude positive, whatever sign the SVD gives (AnotherBackend negates every second pair),
    against the dense float64 SVD; its extremes rank twins by token id, against a brute-force sort."""
    model = tiny_model()
    planted_twins(model, [(4, 30), (4, 2), (9, 11)], embed=True, unembed=True)
    writer, reader = sc.Writer("embed"), sc.Reader("unembed")
    dense = model.embed.W_E @ model.unembed.W_U  # [V, V]
    U, S, Vh = torch.linalg.svd(dense)
    for backend in (False, True):
        with AnotherBackend() if backend else contextlib.nullcontext():
            svd = vw.factored_svd(vw.virtual_weight(model, writer, reader), k=4)
            rep = vw.pair_report(model, writer, reader, k=4, n_top=5)
        for i, d in enumerate(rep.directions):
            u = signed_by_largest_entry(U[:, i].tolist())
            v = [x * (1 if u[0] * U[0, i] > 0 else -1) for x in Vh[i].tolist()]  # the same sign on both sides
            torch.testing.assert_close(svd.U[:, i], torch.tensor(u, dtype=torch.float64), rtol=0, atol=1e-9)
            torch.testing.assert_close(svd.V[:, i], torch.tensor(v, dtype=torch.float64), rtol=0, atol=1e-9)
            u_got, v_got = svd.U[:, i].tolist(), svd.V[:, i].tolist()  # the values ranked (twins equal exactly)
            assert [t for t, _ in d.input_top] == by_value_then_index(u_got, 5)
            assert [t for t, _ in d.input_bottom] == by_value_then_index(u_got, 5, largest=False)
            assert [t for t, _ in d.output_top] == by_value_then_index(v_got, 5)
            assert [t for t, _ in d.output_bottom] == by_value_then_index(v_got, 5, largest=False)
    twins = [u for u in svd.U.T.tolist() if u[4] == u[30] == u[2] and u[9] == u[11]]
    assert len(twins) == 4  # the planted ties are exact


def test_by_value_then_indices_is_the_brute_force_order() -> None:
    values = planted_ties(4, 30, seed=3)  # [4, 30]
    g = torch.Generator().manual_seed(4)
    rows, cols = torch.randint(0, 3, (4, 30), generator=g), torch.randint(0, 3, (4, 30), generator=g)
    for largest in (True, False):
        with AnotherBackend():
            order = by_value_then_indices(values, (rows, cols), largest)
        for b in range(4):
            sign = -1 if largest else 1
            triples = zip(values[b].tolist(), rows[b].tolist(), cols[b].tolist(), strict=True)
            keys = [(sign * v, r, c) for v, r, c in triples]
            assert [keys[i] for i in order[b].tolist()] == sorted(keys)


@pytest.mark.parametrize("largest", [True, False])
def test_a_global_top_k_lists_twin_entries_by_row_then_column(largest: bool) -> None:
    """A [30, 6] @ B [6, 25] with twin rows and columns: the top k's entries are the dense product's, in the order of
    value, then row, then column, on either backend (k where no tie crosses the k-th place: which tied entries are
    listed there is the search's)."""
    g = torch.Generator().manual_seed(5)
    A, B = torch.randn(30, 6, generator=g, dtype=torch.float64), torch.randn(6, 25, generator=g, dtype=torch.float64)
    dense = A @ B
    top = (dense.argmax() if largest else dense.argmin()).item()
    i, j = divmod(top, 25)
    A[[3, 20, 29]] = A[i].clone()  # twins of the extreme entry's row and column
    B[:, [0, 11]] = B[:, [j]].clone()
    dense = (A @ B).tolist()
    entries = sorted((-v if largest else v, r, c) for r, row in enumerate(dense) for c, v in enumerate(row))
    k = next(n for n in range(12, 40) if entries[n - 1][0] != entries[n][0])  # no tie across the k-th place
    assert len({v for v, _, _ in entries[:k]}) < k  # ties among the listed
    for backend in (False, True):
        with AnotherBackend() if backend else contextlib.nullcontext():
            values, rows, cols = FactoredMatrix(A, B).topk_global(k, largest=largest)
        got = [(v, r, c) for v, r, c in zip(values.tolist(), rows.tolist(), cols.tolist(), strict=True)]
        assert [(r, c) for _, r, c in got] == [(r, c) for _, r, c in entries[:k]]


def test_a_crowded_directions_writers_of_equal_share_rank_in_the_writers_order() -> None:
    """Twin writers (the same subspace) share every direction equally: listed in the writers' order."""
    g = torch.Generator().manual_seed(6)
    basis = lambda: torch.linalg.qr(torch.randn(12, 3, generator=g, dtype=torch.float64))[0]  # noqa: E731
    a, c = basis(), basis()
    names, bases = ["a", "b", "c", "d", "e"], [a, c, a.clone(), c.clone(), a.clone()]
    with AnotherBackend() as mode:
        bw = residual_stream.bandwidth(names, bases, 12, n_crowded=4, n_writers=5)
    assert mode.calls
    for _, writers in bw.crowded:
        shares = {n: s for n, s in writers}
        assert shares["a"] == shares["c"] == shares["e"] and shares["b"] == shares["d"]  # the ties
        assert writers == sorted(writers, key=lambda w: (-w[1], names.index(w[0])))


def test_virtual_heads_of_twin_heads_rank_in_head_order() -> None:
    """rank_by_v_composition on a model whose layer 0 heads are twins: equal scores listed by (h1, h2)."""
    model = tiny_model(n_heads=3)
    attn = model.blocks[0].attn
    with torch.no_grad():
        for h in (1, 2):
            attn.W_V[h].copy_(attn.W_V[0])
            attn.W_O[h].copy_(attn.W_O[0])
    with AnotherBackend() as mode:
        ranked = rank_by_v_composition(model, k=9)
    assert mode.calls
    assert len({s for _, _, s in ranked}) < len(ranked)  # the ties
    order = lambda name: tuple(int(x) for x in name[1:].split("H"))  # noqa: E731
    assert ranked == sorted(ranked, key=lambda r: (-r[2], order(r[0]), order(r[1])))
