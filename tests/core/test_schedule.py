"""The engine's scheduling module: which thread runs what, and that every branch's result (or error) comes back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from circuits_core.schedule import (
    Handoff,
    available_cores,
    halves_side_by_side,
    in_background,
    later,
    sampling,
    shared_chunks,
    shared_tasks,
    side_by_side,
    split_loop,
    yielding,
)


def test_side_by_side_runs_the_side_branch_in_a_helper_thread_only_when_a_core_is_idle() -> None:
    def where() -> tuple[str, int]:
        return threading.current_thread().name, torch.get_num_threads()

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(available_cores())  # no idle core: one after the other, here
        (m, s) = side_by_side(where, where, "qkov-test-side")
        assert m == s == (threading.current_thread().name, available_cores())
        if available_cores() >= 2:
            torch.set_num_threads(1)
            (m, s) = side_by_side(where, where, "qkov-test-side")
            assert m == (threading.current_thread().name, 1)
            assert s[0].startswith("qkov-test-side") and s[1] == 1  # the caller's thread count goes along
            for grad in (False, True):  # and its grad mode (thread-local in torch)
                with torch.set_grad_enabled(grad):
                    assert side_by_side(torch.is_grad_enabled, torch.is_grad_enabled) == (grad, grad)

        def boom() -> None:
            raise ValueError("side failed")

        with pytest.raises(ValueError, match="side failed"):
            side_by_side(lambda: 1, boom)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(available_cores() < 2, reason="a helper thread needs a second core")
def test_yielding_gives_the_other_core_back_while_it_is_wanted_and_every_chunk_is_still_taken_once() -> None:
    """Inside yielding(wanted): no helper starts while wanted() is true; a helper already running stops taking
    chunks once it becomes true, and the main branch takes the rest, so the loop covers the range exactly once."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with yielding(lambda: True):
            main, side = side_by_side(threading.current_thread, threading.current_thread, "qkov-test-yield")
        assert main is side is threading.current_thread()  # wanted from the start: no helper

        wanted = threading.Event()
        take = shared_chunks(40, 1)
        taken: dict[str, list[int]] = {"main": [], "side": []}

        def loop(who: str) -> str:
            while (s := take()) is not None:
                taken[who].append(s.start)
                if who == "side" and len(taken["side"]) == 2:
                    wanted.set()  # the cores are wanted from now on: the helper takes no third chunk
                time.sleep(0.01)
            return threading.current_thread().name

        with yielding(wanted.is_set):
            names = side_by_side(lambda: loop("main"), lambda: loop("side"), "qkov-test-yield")
        assert names[1].startswith("qkov-test-yield")  # not wanted at the start: a helper ran
        assert len(taken["side"]) == 2  # then it gave the core back (wanted to the end)
        assert sorted(taken["main"] + taken["side"]) == list(range(40))  # every chunk once
        free = shared_chunks(4, 1)  # outside a yielding block, helpers are never stopped
        a, b = side_by_side(lambda: [free()], lambda: [free()], "qkov-test-yield")
        assert None not in a + b
    finally:
        torch.set_num_threads(before)


def test_shared_chunks_cover_the_range_once_between_two_threads() -> None:
    take = shared_chunks(103, 10)
    seen: list[list[int]] = [[], []]

    def drain(i: int) -> None:
        while (rows := take()) is not None:
            seen[i].extend(range(rows.start, rows.stop))

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(seen[0] + seen[1]) == list(range(103))


def test_shared_tasks_run_every_task_once_each_with_its_worker_workspace() -> None:
    before = torch.get_num_threads()
    ran: list[tuple[int, int]] = []
    workspaces: list[list[int]] = []

    def workspace() -> list[int]:
        space: list[int] = []
        workspaces.append(space)
        return space

    def task(i: int) -> Callable[[list[int]], None]:
        def run(space: list[int]) -> None:
            space.append(i)
            ran.append((i, id(space)))

        return run

    try:
        torch.set_num_threads(1)  # a core idle when the machine has two: two workers
        shared_tasks([task(i) for i in range(9)], workspace)
    finally:
        torch.set_num_threads(before)
    assert sorted(i for i, _ in ran) == list(range(9))
    assert len(workspaces) == (2 if available_cores() >= 2 else 1) and sorted(sum(workspaces, [])) == list(range(9))
    assert all(i in next(w for w in workspaces if id(w) == space) for i, space in ran)


@pytest.mark.parametrize(
    "failing",
    ["caller", pytest.param("helper", marks=pytest.mark.skipif(available_cores() < 2, reason="no helper on one core"))],
)
def test_shared_tasks_stop_both_workers_once_a_task_fails(failing: str) -> None:
    """A failed task ends the whole queue: the other worker finishes the task in hand and takes no further one, so
    the error comes up at once instead of after the rest of 10,000 slow tasks (about 100 s)."""
    before = torch.get_num_threads()
    here, lock = threading.current_thread().name, threading.Lock()
    taken: list[int] = []

    def task(i: int) -> Callable[[None], None]:
        def run(_: None) -> None:
            in_caller = threading.current_thread().name == here
            if in_caller == (failing == "caller"):
                with lock:
                    taken.append(i)
                    failing_now = len(taken) == 3
                if failing_now:
                    raise MemoryError("refused")
            else:
                time.sleep(0.01)

        return run

    try:
        torch.set_num_threads(1)  # a core left for the helper (where there is one)
        start = time.perf_counter()
        with pytest.raises(MemoryError, match="refused"):
            shared_tasks([task(i) for i in range(10_000)], lambda: None, "qkov-test-tasks")
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(before)
    assert len(taken) == 3
    assert elapsed < 20  # the other worker stopped too


def test_halves_side_by_side_gives_a_caller_on_every_core_half_its_threads_and_restores_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = torch.get_num_threads()
    seen: list[tuple[int, int]] = []
    try:
        for cores, threads in ((4, 4), (4, 2), (2, 1), (8, 6)):
            monkeypatch.setattr("circuits_core.schedule.available_cores", lambda cores=cores: cores)
            torch.set_num_threads(threads)
            with halves_side_by_side():
                seen.append((threads, torch.get_num_threads()))
            assert torch.get_num_threads() == threads
        torch.set_num_threads(4)
        with pytest.raises(RuntimeError, match="inside"), halves_side_by_side():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 4  # restored after an error too
    finally:
        torch.set_num_threads(before)
    # all four cores: half each; two of four already leave cores idle; one thread stays one; six of eight: three
    assert seen == [(4, 2), (2, 2), (1, 1), (6, 3)]


def test_a_handoff_reaches_the_waiting_branch_and_so_does_its_error() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        value: Handoff[int] = Handoff()
        assert side_by_side(lambda: value.give(lambda: 41) + 1, lambda: value.take()) == (42, 41)

        failing: Handoff[int] = Handoff()

        def form() -> int:
            raise ValueError("formed badly")

        waited: list[BaseException] = []

        def wait() -> int:
            try:
                return failing.take()
            except ValueError as error:
                waited.append(error)
                raise

        with pytest.raises(ValueError, match="formed badly"):
            side_by_side(lambda: failing.give(form), wait)
        if available_cores() >= 2:  # side by side: the waiting branch got the error too, it did not hang
            assert len(waited) == 1 and str(waited[0]) == "formed badly"
    finally:
        torch.set_num_threads(before)


def test_in_background_runs_beside_the_caller_and_waits_on_exit() -> None:
    here = threading.current_thread().name
    with in_background() as background:
        job = background.start(lambda: threading.current_thread().name)
        slow = background.start(lambda: time.sleep(0.05) or "done")
    assert job.result() != here and job.result().startswith("qkov-background")
    assert slow.done() and slow.result() == "done"


def test_later_runs_jobs_in_order_on_one_worker_beside_the_caller() -> None:
    here = threading.current_thread().name
    order: list[int] = []
    jobs = [later(lambda i=i: (time.sleep(0.01 * (3 - i)), order.append(i), threading.current_thread().name)[2])
            for i in range(3)]  # fmt: skip
    names = {job.result(timeout=5) for job in jobs}
    assert order == [0, 1, 2]  # in the order given, though the first sleeps longest: one worker
    assert len(names) == 1 and here not in names and names.pop().startswith("qkov-later")


def test_sampling_samples_in_another_thread_while_the_block_runs_and_never_after() -> None:
    seen: list[str] = []
    with sampling(lambda: seen.append(threading.current_thread().name), 0.002, name="qkov-test-sampler"):
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
    after = len(seen)
    time.sleep(0.02)
    assert after >= 3 and set(seen) == {"qkov-test-sampler"}
    assert len(seen) == after  # stopped and joined on exit
    assert "qkov-test-sampler" not in {t.name for t in threading.enumerate()}


def test_split_loop_covers_the_range_once_and_its_helper_stops_when_the_caller_fails() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # a core left for the helper (where there is one)
        seen: list[tuple[str, int]] = []
        lock = threading.Lock()

        def record(part: slice) -> None:
            time.sleep(0.005)  # long enough that neither thread drains the queue alone
            with lock:
                seen.extend((threading.current_thread().name, i) for i in range(part.start, part.stop))

        split_loop(53, 5, record, "qkov-test-loop")
        assert sorted(i for _, i in seen) == list(range(53))
        if available_cores() >= 2:
            assert {name.startswith("qkov-test-loop") for name, _ in seen} == {True, False}  # both threads took some

        here = threading.current_thread().name
        taken: list[int] = []

        def fails_here(part: slice) -> None:  # the caller's third slice fails; the helper's are slow
            if threading.current_thread().name == here:
                with lock:
                    taken.append(part.start)
                if len(taken) == 3:
                    raise MemoryError("refused")
            else:
                time.sleep(0.01)

        start = time.perf_counter()
        with pytest.raises(MemoryError, match="refused"):
            split_loop(10_000, 1, fails_here, "qkov-test-loop")
        assert len(taken) == 3
        assert time.perf_counter() - start < 20  # the helper stopped too (its 10,000 slices would take 100 s)
    finally:
        torch.set_num_threads(before)


def _forward() -> None:
    from circuits_core.model.config import ModelConfig
    from circuits_core.model.transformer import random_model

    model = random_model(ModelConfig(n_layers=4, d_model=16, n_heads=2, d_head=8, d_vocab=50, n_ctx=8), seed=0)
    model(torch.zeros(1, 8, dtype=torch.long))


def _gram_inner_products() -> None:
    from circuits_core.circuits.stream_grams import factors, inner_products

    F = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0))
    inner_products([factors(F)], [factors(F)], block=16)  # several column blocks


def _own_rank_scan() -> None:
    from circuits_core.circuits.own_rank import scan

    M = torch.randn(4, 400, generator=torch.Generator().manual_seed(0))
    own = torch.arange(4)
    scan(lambda rows, cols: M[rows][:, cols], M[own, own] + 100, own, torch.arange(4), 400, 3, 64, first_block=8)


@pytest.mark.skipif(available_cores() < 2, reason="a helper thread needs a second core")
@pytest.mark.parametrize("work", [_forward, _gram_inner_products, _own_rank_scan], ids=["layers", "grams", "scan"])
def test_a_helper_gives_way_within_its_work(work: Callable[[], None]) -> None:
    """A background job's helper thread (side_by_side inside yielding) waits at the give_way points of its work while
    the cores are wanted (between a forward pass's layers, Gram blocks, the self-copy scan's column blocks), not only
    before its next shared chunk: work started before the cores were wanted ends only after they are no longer
    wanted. The main branch never waits."""
    wanted, released = threading.Event(), threading.Event()
    before = torch.get_num_threads()
    torch.set_num_threads(1)

    def side() -> float:
        wanted.set()  # a request wants the cores from now on, while this work runs
        work()
        return time.monotonic()

    def main() -> float:
        wanted.wait()
        work()  # the main branch runs on
        time.sleep(0.3)
        released.set()
        at = time.monotonic()
        wanted.clear()
        return at

    try:
        with torch.no_grad(), yielding(wanted.is_set):
            cleared, done = side_by_side(main, side, "qkov-test-give-way")
    finally:
        torch.set_num_threads(before)
    assert released.is_set() and done >= cleared  # the helper's work waited for the cores to be given back
