"""Fill the result store with everything a model's pages read, before traffic arrives.

    python -m app.precompute toy-2l                 # every page of the model, each head's page, the API defaults
    python -m app.precompute gpt2 --heads L0H1,L5H5   # only these heads' pages (the model-wide pages too)
    python -m app.precompute gpt2 --full            # also the whole-vocabulary tables (vocab=all) of a large vocabulary

It opens each page of the model at its default parameters through the app itself (in process, no socket),
so every table a page reads (the heads table, Q/K/V composition, each head's circuits, the default prompt's
analyses...) goes into the store the settings name (`QKOV_STORE_URL`: the disk store by default, or Redis
shared by replicas) under exactly the key and encoding the server uses: a visitor's request later is a store
hit. Keys already in the store are store hits here too, so an interrupted run resumes where it stopped.
Progress is a tqdm bar on stderr; the last line says how many computations ran, how many answers came from
the store, and how long it took. A page that answers 4xx for this model (e.g. composition on a 1-layer model)
is listed, not fatal.

Pages are asked 2 x `compute_slots` at a time (the slots still bound the computations, each with cores // slots
torch threads; the second page per slot renders or waits while the first computes), in order: the
model-wide pages, the first head's (which computes what every head view shares: the heads table, the spectra
of all heads, the composition partners; the other heads are queued once it is done), the other heads, then the
panels those pages load after themselves (hx-trigger="load": the copying panels), asked as htmx asks them (the
first head's right after it), and last the pages assembled from what those panels measured (ASSEMBLED: the copying
overview reads each head's rows off its panel's entry). The last line says when each group was done. On a vocabulary
over DEFAULT_VOCAB tokens a page's global tables rank the default token set (app/views/shared/token_sets.py); `--full`
also fills each head's and the direct path's whole-vocabulary tables (`vocab=all`), ~38x the work per table on GPT-2.
"""

from __future__ import annotations

import argparse
import html
import logging
import re
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi.testclient import TestClient
from pydantic import ValidationError
from tqdm import tqdm

from app.main import create_app
from app.params import DEFAULT_VOCAB, HeadParams
from app.routers.navigation import fits, needs_layers, needs_mlp
from app.routers.pages import PAGES
from app.settings import Settings
from app.views.copying import COPYING_ALL
from circuits_core.errors import QkovError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import all_heads, head_name

HEAD_APIS = ("heads/{head}/ov", "heads/{head}/qk")  # the API twins a notebook asks first
# Analyses whose model-wide answer (no `heads=`) is assembled from entries the head pages' panels keep in the cache
# (app/views/copying.py circuit_rows): asked after those panels, they measure nothing again.
ASSEMBLED = (COPYING_ALL,)
# Pages in flight per compute slot: while one renders its page or waits between its computations (Python, one event
# loop), another's computation keeps the slot busy; the slots still bound the heavy work.
REQUESTS_PER_SLOT = 2
SLOT_WAIT_S = 24 * 3600.0
# A panel a page loads after itself (templates/_macros.html lazy_panel): htmx asks its hx-get with its own id as target.
LAZY_PANEL = re.compile(r'<[^>]*\bid="([^"]+)"[^>]*\bhx-get="([^"]+)"[^>]*\bhx-trigger="load"')


def lazy_panels(page: str) -> list[tuple[str, str]]:
    """(url, element id) of each panel the page loads after itself."""
    return [(html.unescape(src), target) for target, src in LAZY_PANEL.findall(page)]


def page_urls(app: Any, model: str) -> tuple[list[str], list[str]]:
    """(the model-wide pages, the per-head page templates with `{head}`) of this app that apply to the model: a page
    the navigation leaves out of it (too few attention layers, no MLP) answers 422 there, and is not asked."""
    cfg = app.state.registry.get(model).model.cfg
    routes = sorted(
        {p.route for p in PAGES if fits(needs_layers(p.analysis), needs_mlp(p.analysis), cfg.n_layers, cfg.attn_only)}
    )
    model_wide = [f"/models/{model}"]
    per_head = [f"/api/v1/models/{model}/{path}" for path in HEAD_APIS]
    for route in routes:
        if route == "/models/{model}" or not route.startswith("/models/{model}"):
            continue  # the overview is first; server-wide pages (the tour) are not one model's
        url = route.replace("{model}", model)
        fields = url.count("{")
        if fields == 0:
            model_wide.append(url)
        elif fields == 1 and "{head}" in url:
            per_head.append(url)
    return model_wide, per_head


def heads_of(loaded: LoadedModel, only: str | None) -> list[str]:
    cfg = loaded.model.cfg
    if only:
        return [HeadParams(head=h.strip()).normalised(loaded).head for h in only.split(",") if h.strip()]
    return [head_name(*pair) for pair in all_heads(cfg)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.precompute", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model id (a folder name, as in the URLs)")
    parser.add_argument("--heads", help="comma-separated heads (L1H4,...); default: every head")
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"also the whole-vocabulary tables (vocab=all) of a vocabulary over {DEFAULT_VOCAB:,} tokens",
    )
    args = parser.parse_args(argv)

    # a batch job waits for every table, and for a compute slot however long the pages ahead of it take
    settings = Settings().model_copy(update={"request_timeout_s": None, "slot_wait_s": SLOT_WAIT_S})
    if settings.store_url == "off":
        parser.error("the result store is off (QKOV_STORE_URL=off): nothing to fill")
    app = create_app(settings)
    access = logging.getLogger("qkov.access")
    level = access.level
    access.setLevel(logging.WARNING)  # the bar says where it is; no line per page
    try:
        return crawl(app, args, parser, settings)
    finally:
        access.setLevel(level)


def full_urls(loaded: LoadedModel, model: str, per_head: list[str]) -> list[str]:
    """With --full on a large vocabulary: the per-head circuit pages, their API twins, the direct path at vocab=all."""
    if loaded.model.cfg.d_vocab <= DEFAULT_VOCAB:
        return []  # the default tables already rank every token
    circuits = [u for u in per_head if u.endswith(("/ov", "/qk")) or u.endswith("/heads/{head}")]
    return [f"/models/{model}/direct?vocab=all", *(f"{u}?vocab=all" for u in circuits)]


def crawl(app: Any, args: argparse.Namespace, parser: argparse.ArgumentParser, settings: Settings) -> int:
    with TestClient(app) as client:
        try:
            loaded = app.state.registry.get(args.model)
            heads = heads_of(loaded, args.heads)
        except QkovError as exc:
            parser.error(str(exc))
        except ValidationError as exc:  # a head name the params refuse before parsing it (e.g. over 16 characters)
            parser.error("--heads: " + "; ".join(f"{e['input']!r}: {e['msg']}" for e in exc.errors()))
        model_wide, per_head = page_urls(app, args.model)
        if args.full:
            extra = full_urls(loaded, args.model, per_head)
            model_wide += [u for u in extra if "{head}" not in u]
            per_head += [u for u in extra if "{head}" in u]
        phases = {
            "model-wide pages": model_wide,
            "first head": [u.replace("{head}", h) for h in heads[:1] for u in per_head],
            "other heads": [u.replace("{head}", h) for h in heads[1:] for u in per_head],
        }
        service, refused = app.state.compute, []
        assembled = {f"/models/{args.model}/{a.path}" for a in ASSEMBLED}
        panels: dict[tuple[str, str], None] = {}  # (url, target) -> None: the panels found, in order, each once
        before, start = service.stats.completed, time.perf_counter()
        bar = tqdm(
            total=sum(map(len, phases.values())),
            desc=f"precompute {args.model}",
            unit="page",
            file=sys.stderr,
            mininterval=1.0,
        )

        def visit(url: str, headers: dict[str, str] | None = None) -> None:
            response = client.get(url, headers={"Accept-Encoding": "identity", **(headers or {})})
            if response.status_code >= 400:
                refused.append(f"{url} ({response.status_code})")
            bar.update()
            if headers is None and response.headers.get("content-type", "").startswith("text/html"):
                for src, target in lazy_panels(response.text):
                    panels.setdefault((src, target), None)

        done: dict[str, float] = {}  # phase -> seconds from the start until its last page answered

        def run(name: str, jobs: list[Future[None]]) -> None:
            for job in jobs:
                job.result()
            done[name] = time.perf_counter() - start

        def ask_panel(panel: tuple[str, str]) -> None:  # as htmx asks it, so the page cache key matches
            visit(panel[0], {"HX-Request": "true", "HX-Target": panel[1]})

        def last(url: str) -> bool:  # a model-wide answer assembled from what the head pages' panels measure
            parts = urlsplit(url)
            return parts.path in assembled and "heads" not in parse_qs(parts.query)

        with ThreadPoolExecutor(REQUESTS_PER_SLOT * settings.compute_slots) as pool:
            # Queued in order; only the first head is waited for before its panels and the other heads are queued
            # (it computes what the others share: the heads table, every head's spectra; its panel the copying
            # baseline's rows, done before any other panel is queued), so no core idles while the last model-wide
            # pages finish. Pages assembled from the per-head panels' entries (ASSEMBLED) come last.
            model_pages = [pool.submit(visit, u) for u in phases["model-wide pages"] if not last(u)]
            model_pages[0].result()  # the overview: its heads table is what a head page reads first (built once)
            run("first head", [pool.submit(visit, u) for u in phases["first head"]])
            first = [
                p for p in panels if not last(p[0])
            ]  # the first head's panels (and those of the model-wide pages done by then)
            bar.total += len(first)
            first_panels = [pool.submit(ask_panel, p) for p in first]  # ahead of the other heads (the baseline's rows)
            head_pages = [pool.submit(visit, u) for u in phases["other heads"]]
            run("its panels", first_panels)
            run("model-wide pages", model_pages)
            run("heads", head_pages)
            asked = set(first)
            rest = [p for p in panels if p not in asked and not last(p[0])]
            bar.total += len(rest)
            run(f"{len(first) + len(rest)} panels", [pool.submit(ask_panel, p) for p in rest])
            final = [u for u in phases["model-wide pages"] if last(u)]
            late = [p for p in panels if last(p[0])]
            bar.total += len(late)
            run(
                f"{len(final) + len(late)} assembled pages and panels",
                [*(pool.submit(visit, u) for u in final), *(pool.submit(ask_panel, p) for p in late)],
            )
        bar.close()
        store = service.store
        print(
            f"{args.model}: {bar.total} pages, {service.stats.completed - before} computations, "
            f"{store.hits if store else 0} answers already in the {settings.store_url.split(':')[0]} store, "
            f"{time.perf_counter() - start:.1f} s (done after: {', '.join(f'{n} {t:.1f} s' for n, t in done.items())})"
        )
        if refused:
            print("not available for this model: " + ", ".join(sorted(refused)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
