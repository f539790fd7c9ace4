"""What runs beside what: the engine's one scheduling module.

The maths modules say which two computations are independent and this module decides how they run:
    side_by_side(main, side)   main here and side in a helper thread when the caller's torch threads leave a core
                               idle (a server computation has one torch thread per compute slot), one after the
                               other otherwise; the helper inherits the caller's torch thread count, grad mode and
                               stop flag (circuits_core.cost.stopping)
    shared_chunks(total, n)    a queue of slices that both branches of side_by_side take from, so they split one
                               chunked loop and finish it together
    shared_tasks(tasks)        the same queue over a list of tasks, longest first; a failed task stops both workers
    on_workspaces(tasks, ws)   the tasks on workspaces allocated beforehand: in turn on one, or shared_tasks by two
                               workers of one torch thread each, one workspace each
    split_loop(total, n, work) a chunked loop split that way, either thread stopping when the other fails
    Handoff                    a value one branch forms and the other waits for (an error reaches both)
    in_background()            I/O beside the caller (a checkpoint's digest while torch reads its tensors)
    later(job)                 job in the process's one worker for results wanted later, in order (a GGUF tokenizer
                               built once load_checkpoint has built the model)
    sampling(sample, every_s)  sample() every every_s seconds in a daemon thread while the block runs (a load's
                               memory watchdog reading the process's RSS)
    yielding(wanted)           within it, the cores are given up while wanted() says other work needs them: no
                               helper thread starts, and a helper already running waits before its next shared
                               chunk (the main branch goes on); a server's background jobs run inside it
    give_way()                 a point inside a long chunk (between a forward pass's layers) where such a helper
                               waits too, so it gives its core back within a layer, not at the chunk's end
    one_thread()               one torch thread within the block (thousands of short ops: loads, tiled products)
    halves_side_by_side()      within the block, a caller on all the cores gets half its threads, so its
                               side_by_side branches run side by side on one half each (the heads table)
    per_thread(fn, parts)      fn over independent parts (a batch of small LAPACK problems), one thread of one torch
                               thread per part, as many parts as the caller has torch threads
Two threads, never more, beside one another: a lone request then uses two cores without an OpenMP team, which stalls
at every barrier when its threads share busy cores. per_thread stays within the caller's own torch threads, and
gives each of them one independent part instead of one OpenMP team over a batch. Cancellation is the stop flag's
business (circuits_core.cost.check_stop).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from typing import Generic, TypeVar

import torch

A = TypeVar("A")
B = TypeVar("B")
T = TypeVar("T")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), which bound how much of a computation runs at once."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# wanted() of the innermost `yielding` block (None outside one), and whether this thread is a side_by_side helper
_WANTED: ContextVar[Callable[[], bool] | None] = ContextVar("qkov_cores_wanted", default=None)
_HELPER: ContextVar[bool] = ContextVar("qkov_side_helper", default=False)
YIELD_POLL_S = 0.01  # how often a helper that gave its core back asks whether it is still wanted


@contextmanager
def yielding(wanted: Callable[[], bool]) -> Iterator[None]:
    """Within the block (and the helpers it starts), side_by_side starts no helper while wanted() is true, and a
    helper takes no chunk of shared_chunks / shared_tasks while it is (it waits, and goes on when it is not): work of
    lower priority (a server's background job) gives the other core back to the work that wants it, at the next
    chunk, without changing what is computed (every chunk is still taken once, by one branch or the other)."""
    token = _WANTED.set(wanted)
    try:
        yield
    finally:
        _WANTED.reset(token)


def _cores_wanted() -> bool:
    wanted = _WANTED.get()
    return wanted is not None and wanted()


def give_way() -> None:
    """In a side_by_side helper within a `yielding` block: wait here while the cores are wanted. Anywhere else (the
    main branch, or no yielding block) return at once, so long loops may call it at every step."""
    while _HELPER.get() and _cores_wanted():
        time.sleep(YIELD_POLL_S)


def side_by_side(main: Callable[[], A], side: Callable[[], B], name: str = "qkov-side") -> tuple[A, B]:
    """(main(), side()) for two independent computations: side in a helper thread (named `name`, with the caller's
    torch thread count, grad mode and stop flag) while main runs here, when the caller's torch threads leave a core
    idle and no `yielding` block says the core is wanted; one after the other otherwise."""
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    if 2 * threads > available_cores() or _cores_wanted():
        return main(), side()

    def in_helper() -> B:
        _HELPER.set(True)  # in the helper's copy of the context only
        torch.set_num_threads(threads)
        with torch.set_grad_enabled(grad):  # grad mode is per thread: the caller's no_grad goes along
            return side()

    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:
        branch = pool.submit(copy_context().run, in_helper)  # the ambient stop flag goes along
        first = main()
        return first, branch.result()


def shared_chunks(total: int, chunk: int) -> Callable[[], slice | None]:
    """A queue of the slices [start, start + chunk) covering range(total), shared by threads: each call takes the next
    one (None when none is left), so side_by_side's branches split a chunked loop and finish it together. A helper
    inside a `yielding` block waits while the cores are wanted (the main branch goes on taking chunks), and takes
    chunks again once they are not, or gets None when the main branch has taken the last."""
    chunk = max(1, chunk)
    starts, lock = list(range(0, total, chunk))[::-1], threading.Lock()  # popped from the end: in order

    def take() -> slice | None:
        while _HELPER.get() and _cores_wanted() and starts:
            time.sleep(YIELD_POLL_S)
        with lock:
            start = starts.pop() if starts else None
        return None if start is None else slice(start, min(start + chunk, total))

    return take


def _worker(take: Callable[[], slice | None], start: Callable[[], Callable[[slice], None]]) -> Callable[[], None]:
    """One worker function for both branches of side_by_side over the shared queue `take`: start() once per worker
    (say, its own workspace) gives the worker's work(part), then it takes parts until none is left. Once either
    worker fails (a load's watchdog refusing it, a task's error), the other takes no further part, so a failed
    computation does not keep the other core busy with the rest of the queue; the error goes on up."""
    failed = threading.Event()

    def worker() -> None:
        try:
            work = start()
            while not failed.is_set() and (part := take()) is not None:
                work(part)
        except BaseException:
            failed.set()
            raise

    return worker


def shared_tasks(tasks: Sequence[Callable[[T], None]], workspace: Callable[[], T], name: str = "qkov-tasks") -> None:
    """Run every task once, in order, by two workers side by side, each with its own workspace (workspace() once per
    worker): a worker takes the next task when it finishes its last, so tasks listed longest first balance. Once a
    task fails, the other worker takes no further task."""

    def start() -> Callable[[slice], None]:
        space = workspace()
        return lambda task: tasks[task.start](space)

    worker = _worker(shared_chunks(len(tasks), 1), start)
    side_by_side(worker, worker, name)


def on_workspaces(tasks: Sequence[Callable[[T], None]], spaces: Sequence[T], name: str = "qkov-tasks") -> None:
    """Run every task once on workspaces the caller allocated (one per worker, so their memory is held before any
    work starts): in turn on the only one, or by two workers side by side (shared_tasks), each with one torch thread
    and one of the workspaces."""
    if len(spaces) == 1:
        for task in tasks:
            task(spaces[0])
        return
    unused = list(spaces)
    with one_thread():
        shared_tasks(tasks, unused.pop, name)


def split_loop(total: int, chunk: int, work: Callable[[slice], None], name: str = "qkov-loop") -> None:
    """work(part) for every slice of range(total) in steps of `chunk`, the slices taken in turn by this thread and a
    helper (side_by_side; one after the other when no core is idle). Once either thread fails (a load's watchdog
    refusing it: its checkpoints are this thread's) the other takes no further slice."""
    worker = _worker(shared_chunks(total, chunk), lambda: work)
    side_by_side(worker, worker, name)


class Handoff(Generic[T]):
    """A value one branch of side_by_side forms (`give`) and the other waits for (`take`); an error in forming it is
    raised in both, so the waiting branch never waits forever."""

    def __init__(self) -> None:
        self._future: Future[T] = Future()

    def give(self, form: Callable[[], T]) -> T:
        try:
            value = form()
        except BaseException as error:
            self._future.set_exception(error)
            raise
        self._future.set_result(value)
        return value

    def take(self) -> T:
        return self._future.result()


class Background:
    """One background thread for I/O beside the caller's own work (in_background)."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool

    def start(self, job: Callable[[], T]) -> Future[T]:
        """Run job in the background thread (after the jobs started before it); its Future."""
        return self._pool.submit(job)


@contextmanager
def in_background() -> Iterator[Background]:
    """Within the block, background.start(job) runs job in one background thread; the block waits for the jobs on
    exit. For I/O beside torch's own work (hashlib releases the GIL), not for maths."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="qkov-background") as pool:
        yield Background(pool)


_LATER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qkov-later")


def later(job: Callable[[], T]) -> Future[T]:
    """job in the process's one worker thread, after the jobs given it before; its Future. For work whose result a
    caller needs later (a GGUF tokenizer built once the model is built), not for maths beside maths (side_by_side)."""
    return _LATER.submit(job)


@contextmanager
def sampling(sample: Callable[[], None], every_s: float, name: str = "qkov-sampler") -> Iterator[None]:
    """Within the block, sample() runs every `every_s` seconds in a daemon thread (first after `every_s`); on exit the
    thread is stopped and joined, so no sample runs after the block."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            sample()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def one_thread() -> Iterator[None]:
    """Within the block torch runs one intra-op thread (restored after). Loaders decode and lay out tensors this
    way: the copies are memory-bound and come as thousands of short parallel regions (a slab each), each stalled
    by a descheduled worker on a shared 2-core machine: the 1B-shaped checkpoint loaded in 82 s wall, 43 s CPU
    on two threads and 18 s wall, 8 s CPU on one (load average ~8); SmolLM2's GGUF in 8-9 s vs 1.2-2.6 s.
    The setting is process-wide (OpenMP's, set from a thread outside any parallel region), so a computation
    running beside a load also runs on one thread until the load ends; the app's compute service sets its own
    count when each computation starts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def halves_side_by_side() -> Iterator[None]:
    """Within the block, a caller whose torch threads span the cores (a lone computation given all of them) runs on
    half of them (restored after), so that side_by_side's branches run side by side on half the threads each
    instead of one after the other on all: both cores stay busy without an OpenMP team's barriers between small
    products (Gemma-3 270M's heads table, bench/RESULTS.md). A caller that already leaves a core idle, or runs one
    thread, is left as it is."""
    threads = torch.get_num_threads()
    if threads < 2 or 2 * threads <= available_cores():
        yield
        return
    torch.set_num_threads(threads // 2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def per_thread(fn: Callable[[A], B], parts: Sequence[A], name: str = "qkov-parts") -> list[B]:
    """[fn(part) for part in parts], the parts run at once by as many threads, each with one torch thread (and the
    caller's grad mode and stop flag): for a batch of small independent problems that torch would solve one at a
    time, or with one OpenMP team per problem (LAPACK's geev on 128 x 128: 5 ms each on a 16-core host). The caller
    splits its batch into at most torch.get_num_threads() parts, so the threads stay its own."""
    grad = torch.is_grad_enabled()
    if len(parts) < 2:
        return [fn(part) for part in parts]

    def one(part: A) -> B:
        torch.set_num_threads(1)
        with torch.set_grad_enabled(grad):
            return fn(part)

    with ThreadPoolExecutor(len(parts), thread_name_prefix=name) as pool:
        futures = [pool.submit(copy_context().run, one, part) for part in parts]
        return [f.result() for f in futures]
