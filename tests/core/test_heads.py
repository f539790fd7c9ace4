"""Head detectors: pattern detectors on synthetic patterns, Olsson's evaluators vs looped references (float64)."""

import torch
from biased_models import small_model

from circuits_core.prompt.detectors import (
    copying_scores,
    detector_scores,
    olsson_tokens,
    pattern_detector_scores,
    previous_token_head,
    standard_tokens,
)
from circuits_core.prompt.frozen import ln_linear
from circuits_core.prompt.head_table import induction_view
from circuits_core.prompt.qk_paths import circuit_positivity, k_composition_circuit


def test_standard_inputs():
    model = small_model(n_layers=2, n_ctx=128)
    tokens = standard_tokens(model, seed=3)
    assert tokens.shape == (10, 101) and (tokens[:, 1:51] == tokens[:, 51:]).all() and (tokens[:, 0] == 0).all()
    ol = olsson_tokens(model, seed=3)
    assert ol.shape == (10, 101) and (ol[:, 1:26] == ol[:, 76:]).all()
    assert torch.equal(standard_tokens(model, seed=3), tokens)


def test_pattern_detectors_on_perfect_heads():
    T = 6
    tokens = torch.cat([torch.tensor([0]), torch.arange(1, T + 1), torch.arange(1, T + 1)])[None]  # BOS + r + r
    n = tokens.shape[1]
    prev = torch.zeros(1, 2, n, n, dtype=torch.float64)
    prev[0, :, 0, 0] = 1
    prev[0, 0, torch.arange(1, n), torch.arange(n - 1)] = 1  # head 0: previous token
    ind = torch.eye(n, dtype=torch.float64)
    for i in range(T + 1, n):
        ind[i] = 0
        ind[i, i - T + 1] = 1  # head 1: perfect induction on the second repeat
    prev[0, 1] = ind
    scores = pattern_detector_scores(prev, tokens)
    assert abs(float(scores["previous_token"][0]) - 1) < 1e-12
    assert abs(float(scores["induction"][1]) - 1) < 1e-12
    assert abs(float(scores["duplicate_token"][1])) < 1e-12


def _prefix_matching_loop(pattern, tokens):
    # pattern [b, H, n, n]: mean over queries with an earlier occurrence of the mass on "earlier occurrence + 1"
    b, H, n, _ = pattern.shape
    total, count = torch.zeros(H, dtype=torch.float64), 0
    for s in range(b):
        for i in range(n):
            targets = {j + 1 for j in range(i) if tokens[s, j] == tokens[s, i] and j + 1 <= i}
            if targets:
                total += pattern[s, :, i, sorted(targets)].sum(-1)
                count += 1
    return total / count


def test_prefix_matching_matches_loop():
    model = small_model(n_layers=2, ln="LN", n_ctx=128)
    tokens = olsson_tokens(model, seed=1)[:3]
    got = detector_scores(model, tokens)["induction"]  # the prefix-matching score
    _, cache = model.run(tokens, names=lambda n: n.endswith("hook_pattern"))
    for layer in range(2):
        ref = _prefix_matching_loop(cache[f"blocks.{layer}.attn.hook_pattern"], tokens)
        torch.testing.assert_close(got[layer], ref, atol=1e-12, rtol=0)


def test_copying_matches_loop():
    model = small_model(n_layers=2, ln="LN", n_ctx=128)
    tokens = olsson_tokens(model, seed=2)[:2]
    got = copying_scores(model, tokens)
    _, cache = model.run(tokens, names=lambda n: n.endswith(("hook_pattern", "hook_result", "ln_final.hook_scale")))
    b, n = tokens.shape
    for layer in range(2):
        for h in range(3):
            ratios = []
            for s in range(b):
                inv = 1 / cache["ln_final.hook_scale"][s, :, 0]
                res = cache[f"blocks.{layer}.attn.hook_result"][s, :, h]  # [n, d]
                logits = ln_linear(model, "ln_final", res, inv) @ model.W_U  # [n, V] full vocabulary
                relu = (logits - logits.mean(-1, keepdim=True)).clamp_min(0)
                distinct = sorted(set(tokens[s].tolist()))
                for i in range(1, n):
                    A = cache[f"blocks.{layer}.attn.hook_pattern"][s, h, i]
                    att = float((A * relu[i, tokens[s]]).sum())
                    tot = float(relu[i, distinct].sum())
                    ratios.append(att / (att + tot) if att + tot > 0 else 0.0)
            ref = 4 * sum(ratios) / len(ratios) - 1
            assert abs(float(got[layer, h]) - ref) < 1e-10
    assert (got >= -1).all() and (got <= 1).all()


def brute_heads_that_matter(scores: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rule by enumeration: the best induction head of layers >= 1, then the best previous-token head below it."""
    ind, prev = scores["induction"], scores["previous_token"]
    L, H = ind.shape
    best = max((float(ind[layer, h]), layer, h) for layer in range(1, L) for h in range(H))
    below = max((float(prev[layer, h]), layer, h) for layer in range(best[1]) for h in range(H))
    return (below[1], below[2]), (best[1], best[2])


def test_induction_view_uses_the_heads_that_matter():
    model = small_model(n_layers=3, ln="LN")
    view = induction_view(model)
    det = detector_scores(model, standard_tokens(model))
    (pl, ph), induction = brute_heads_that_matter(det)
    assert previous_token_head(model, det) == (pl, ph)
    assert view.previous_token_head == f"L{pl}H{ph}"
    for layer in range(pl + 1, 3):
        for h in range(3):
            ref = circuit_positivity(k_composition_circuit(model, (layer, h), (pl, ph)))
            assert abs(float(view.qk_k_composition[layer, h]) - ref) < 1e-8
    assert (view.qk_k_composition[0] == 0).all() and view.ov_copying.shape == (3, 3)


def test_detectors_stop_early_and_match_the_full_run():
    """detector_scores runs only up to the last pattern (run_until) and equals the detectors of a full run."""
    import pytest

    from circuits_core.errors import InvalidInputError

    model = small_model(n_layers=2, n_ctx=128)
    tokens = standard_tokens(model, seed=1)
    _, full = model.run(tokens, names=lambda n: True)
    stop = f"blocks.{model.cfg.n_layers - 1}.attn.hook_pattern"
    part = model.run_until(tokens, stop, names=lambda n: True)
    assert stop in part and "ln_final.hook_scale" not in part and "blocks.1.hook_mlp_out" not in part
    for name, value in part.items():
        torch.testing.assert_close(value, full[name], atol=0, rtol=0)
    got = detector_scores(model, tokens)
    for name, scores in got.items():
        expected = torch.stack(
            [
                pattern_detector_scores(full[f"blocks.{layer}.attn.hook_pattern"], tokens)[name]
                for layer in range(model.cfg.n_layers)
            ]
        )
        torch.testing.assert_close(scores, expected, atol=1e-12, rtol=0, equal_nan=True)
    with pytest.raises(InvalidInputError):
        model.run_until(tokens, "blocks.9.attn.hook_nothing")


def test_head_table_equals_its_parts_whether_its_branches_run_at_once_or_in_turn():
    """head_table shares the detector chunks between this thread and the one forming the Grams + spectra when a core
    is idle (one torch thread here), in turn otherwise: both give the parts computed one by one (one detector pass,
    the spectra from their own Grams, the 2-D view from its own G_E), up to float64 rounding (the chunk sums add in
    another order)."""
    from circuits_core.circuits.copying_spectra import ov_copying_scores, qk_copying_scores
    from circuits_core.prompt.head_table import head_table
    from circuits_core.schedule import available_cores

    model = small_model(n_layers=3, ln="LN", mlp=True)
    tokens = standard_tokens(model, seed=2)
    det = detector_scores(model, tokens)
    ov, qk = ov_copying_scores(model), qk_copying_scores(model)
    iv = induction_view(model, tokens, det)

    def close(a: torch.Tensor, b: torch.Tensor) -> None:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, equal_nan=True)

    before = torch.get_num_threads()
    try:
        for threads in sorted({1, available_cores()}):
            torch.set_num_threads(threads)
            table = head_table(model, tokens, budget_bytes=2**30)
            assert table.detectors.keys() == det.keys()
            for k in det:
                close(table.detectors[k], det[k])
            close(table.ov_copying, ov)
            close(table.qk_copying, qk)
            assert table.induction is not None and table.induction.previous_token_head == iv.previous_token_head
            close(table.induction.qk_k_composition, iv.qk_k_composition)
            close(table.induction.qk_weighted, iv.qk_weighted)
    finally:
        torch.set_num_threads(before)


def test_detector_chunks_shared_by_two_workers_give_the_one_pass_scores():
    """Two workers taking chunks from one shared queue (schedule.shared_chunks): their merged DetectorSums equal the
    detectors of one unchunked forward pass, scored layer by layer with pattern_detector_scores (float64)."""
    from circuits_core.prompt.detectors import detector_sums
    from circuits_core.schedule import shared_chunks

    model = small_model(n_layers=2, ln="LN", mlp=True)
    tokens = standard_tokens(model, seed=5, batch=7)  # 4 chunks of 2 sequences, the last one short
    take = shared_chunks(tokens.shape[0], 2)
    handed = [take(), take()]  # the first worker's share
    first = detector_sums(model, tokens, lambda: handed.pop(0) if handed else None)
    second = detector_sums(model, tokens, take)  # the rest of the queue
    assert float(first.weights["previous_token"][0, 0]) == 4 and float(second.weights["previous_token"][0, 0]) == 3
    got = first.merge(second).scores()
    _, cache = model.run(tokens, names=lambda n: n.endswith("hook_pattern"))
    for layer in range(2):
        want = pattern_detector_scores(cache[f"blocks.{layer}.attn.hook_pattern"], tokens)
        for name, value in want.items():
            torch.testing.assert_close(got[name][layer], value, rtol=0, atol=1e-12, equal_nan=True)


def test_shared_chunks_hand_out_each_slice_once_across_threads():
    """Four threads draining one queue: the slices they got cover range(total) exactly once, `chunk` items each."""
    import threading

    from circuits_core.schedule import shared_chunks

    take = shared_chunks(1003, 7)
    got: list[list[slice]] = [[] for _ in range(4)]

    def drain(mine: list[slice]) -> None:
        while (s := take()) is not None:
            mine.append(s)

    workers = [threading.Thread(target=drain, args=(g,)) for g in got]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    covered = sorted(i for g in got for s in g for i in range(s.start, s.stop))
    assert covered == list(range(1003)) and take() is None
    sizes = [s.stop - s.start for s in sorted((s for g in got for s in g), key=lambda s: s.start)]
    assert sizes == [7] * 143 + [2]  # 1003 = 143 x 7 + 2


def test_head_table_helper_thread_sees_the_ambient_stop_flag():
    """The helper thread of head_table polls the request's stop flag too: a flag raised only there stops it."""
    import threading

    import pytest

    from circuits_core.cost import stopping
    from circuits_core.errors import CancelledError
    from circuits_core.prompt.head_table import head_table
    from circuits_core.schedule import available_cores

    if available_cores() < 2:
        pytest.skip("one core: the branches run in turn")
    model = small_model(n_layers=2, ln="LN")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with stopping(lambda: threading.current_thread().name.startswith("qkov-heads-table")):
            with pytest.raises(CancelledError):
                head_table(model, standard_tokens(model))
    finally:
        torch.set_num_threads(before)


def test_a_model_without_layers_has_no_head_scores_but_its_real_loss() -> None:
    """n_layers 0: nothing to score, and the per-position loss is the direct path's, W_E[t] W_U + b_U written out
    (chunked by a small budget, as the server runs it)."""
    import torch.nn.functional as F

    from circuits_core.model.config import ModelConfig
    from circuits_core.model.transformer import random_model
    from circuits_core.prompt.detectors import detector_run

    cfg = ModelConfig(n_layers=0, d_model=16, n_heads=2, d_head=8, d_vocab=50, n_ctx=32, normalization_type=None)
    model = random_model(cfg, seed=3, dtype=torch.float64, std_embed=0.5)
    tokens = torch.randint(0, 50, (5, 9), generator=torch.Generator().manual_seed(0))
    run = detector_run(model, tokens, budget_bytes=20_000, with_loss=True)
    assert run.scores == {} and run.first_patterns.shape == (0, 2, 9, 9)
    logits = model.W_E[tokens] @ model.W_U + (model.b_U if model.b_U is not None else 0)  # [5, 9, 50]
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 50), tokens[:, 1:].reshape(-1), reduction="none").view(5, 8)
    assert run.losses is not None and torch.allclose(run.losses, expected, atol=1e-12)
    assert detector_run(model, tokens).losses is None


def test_head_table_kernel_peaks_vs_omega_written_out_in_both_branch_modes():
    """A rotary model given μ: each head's kernel peak offset is the argmax over δ = 0..min(64, n_ctx - 1) of
    μ_l Ω_h(δ) μ_l^T / s with Ω_h(δ) = W_Q^h R(-δ) W_K^{gT} formed densely (rotary.omega), whether the spectra
    branch (which measures μ) runs beside the detector pass or after it; without μ there are no peaks."""
    from rotary_models import rotary_model

    from circuits_core.circuits.rotary import omega
    from circuits_core.prompt.head_table import head_table
    from circuits_core.schedule import available_cores

    model = rotary_model(seed=5, n_layers=2, n_key_value_heads=2)
    mu = torch.randn(2, model.cfg.d_model, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    offsets = range(min(64, model.cfg.n_ctx - 1) + 1)
    want = torch.tensor(
        [
            [
                max(offsets, key=lambda d: float(mu[layer] @ omega(model, layer, h, [d]).AB[0] @ mu[layer]))
                for h in range(model.cfg.n_heads)
            ]
            for layer in range(2)
        ]
    )
    assert len(set(want.flatten().tolist())) > 1  # the heads peak at different offsets
    tokens = standard_tokens(model)
    before = torch.get_num_threads()
    try:
        for threads in sorted({1, available_cores()}):
            torch.set_num_threads(threads)
            table = head_table(model, tokens, budget_bytes=2**30, means=lambda: mu, reference_tokens=32)
            assert table.kernel_peak_offset is not None and torch.equal(table.kernel_peak_offset, want)
    finally:
        torch.set_num_threads(before)
    assert head_table(model, tokens).kernel_peak_offset is None
