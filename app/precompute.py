"""Fill the result store with everything a model's pages read, before traffic arrives.

    python -m app.precompute toy-2l                 # every page of the model, each head's page, the API defaults
    python -m app.precompute gpt2 --heads L0H1,L5H5   # only these heads' pages (the model-wide pages too)

It opens each page of the model at its default parameters through the app itself (in process, no socket),
so every table a page reads (the heads table, Q/K/V composition, each head's circuits, the default prompt's
analyses...) goes into the store the settings name (`QKOV_STORE_URL`: the disk store by default, or Redis
shared by replicas) under exactly the key and encoding the server uses: a visitor's request later is a store
hit. Keys already in the store are store hits here too, so an interrupted run resumes where it stopped.
Progress is a tqdm bar on stderr; the last line says how many computations ran, how many answers came from
the store, and how long it took. A page that answers 4xx for this model (e.g. composition on a 1-layer model)
is listed, not fatal.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from fastapi.testclient import TestClient
from tqdm import tqdm

from app.main import create_app
from app.params import HeadParams
from app.routers.pages import PAGES
from app.settings import Settings
from circuits_core.config import head_name
from circuits_core.errors import QkovError
from circuits_core.weights import LoadedModel

HEAD_APIS = ("heads/{head}/ov", "heads/{head}/qk")  # the API twins a notebook asks first


def page_urls(app: Any, model: str) -> tuple[list[str], list[str]]:
    """(the model-wide pages, the per-head page templates with `{head}`) of this app."""
    declared = {p.route for p in PAGES}
    routes = sorted(declared | {a.page_path for a in app.state.analyses.analyses if a.template and a.scope == "model"})
    model_wide = [f"/models/{model}"]
    per_head = [f"/api/v1/models/{model}/{path}" for path in HEAD_APIS]
    for route in routes:
        if not route.startswith("/models/{model}"):
            continue  # server-wide pages (the tour) are not one model's
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
    return [head_name(layer, h) for layer in range(cfg.n_layers) for h in range(cfg.n_heads)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.precompute", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model id (a folder name, as in the URLs)")
    parser.add_argument("--heads", help="comma-separated heads (L1H4,...); default: every head")
    args = parser.parse_args(argv)

    settings = Settings()
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


def crawl(app: Any, args: argparse.Namespace, parser: argparse.ArgumentParser, settings: Settings) -> int:
    with TestClient(app) as client:
        try:
            loaded = app.state.registry.get(args.model)
            heads = heads_of(loaded, args.heads)
        except QkovError as exc:
            parser.error(str(exc))
        model_wide, per_head = page_urls(app, args.model)
        urls = model_wide + [u.replace("{head}", h) for h in heads for u in per_head]
        service, refused = app.state.compute, []
        before, start = service.stats.completed, time.perf_counter()
        for url in tqdm(urls, desc=f"precompute {args.model}", unit="page", file=sys.stderr, mininterval=1.0):
            status = client.get(url, headers={"Accept-Encoding": "identity"}).status_code
            if status >= 400:
                refused.append(f"{url} ({status})")
        took = time.perf_counter() - start
        store = service.store
        print(f"{args.model}: {len(urls)} pages, {service.stats.completed - before} computations, "
              f"{store.hits if store else 0} answers already in the {settings.store_url.split(':')[0]} store, {took:.1f} s")
        if refused:
            print("not available for this model: " + ", ".join(refused))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
