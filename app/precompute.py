"""Fill the result store with every weight-derived table a model's pages read, before traffic arrives.

    python -m app.precompute toy-2l                # heads table, Q/K/V composition, each head's page tables
    python -m app.precompute gpt2 --heads L0H1,L5H5  # only these heads' tables (the model-wide ones too)

The store is the one the settings name (`QKOV_STORE_URL`: the disk store by default, or Redis shared by
replicas), and every answer goes in under exactly the key the server derives (app/analysis.py `cache_key`:
model id, answer digest, analysis name, normalised params), encoded as the server encodes it, so a page asking
for it later is a store hit. Keys already in the store are skipped, so an interrupted run resumes where it
stopped. Progress is a tqdm bar on stderr; the last line says what was computed, skipped and how long it took.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm

from app.analysis import Analysis, AnalysisParams, cache_key
from app.compute import ComputeService, bind, encode, key_text
from app.params import CompositionParams, HeadParams, NoParams, OVParams, QKParams, SkipTrigramParams
from app.registry import ModelRegistry
from app.routers.pages import HeadPageParams
from app.settings import Settings
from app.store import open_store
from app.views.circuits import OV, QK, SKIP_TRIGRAMS
from app.views.composition import COMPOSITION
from app.views.heads import HEAD, HEADS
from circuits_core.config import head_name
from circuits_core.errors import QkovError
from circuits_core.weights import LoadedModel

Job = tuple[Analysis[Any, Any], AnalysisParams]
PAGE_K = HeadPageParams.model_fields["k"].default  # the head page's top-k


def jobs(loaded: LoadedModel, heads: list[str]) -> Iterator[Job]:
    """What the model's pages read from the weights alone: model-wide tables first, then each head's."""
    yield HEADS, NoParams()
    if loaded.model.cfg.n_layers >= 2:
        for kind in ("Q", "K", "V"):
            yield COMPOSITION, CompositionParams(kind=kind)
    for head in heads:
        yield HEAD, HeadParams(head=head)
        for k in sorted({PAGE_K, OVParams.model_fields["k"].default}):  # the page's and the API's default
            yield OV, OVParams(head=head, k=k)
            yield QK, QKParams(head=head, k=k, side="query")
        yield SKIP_TRIGRAMS, SkipTrigramParams(head=head, k=PAGE_K)


def all_heads(loaded: LoadedModel, only: str | None) -> list[str]:
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
    store = open_store(settings.store_url, settings.store_dir, settings.store_bytes, settings.store_ttl_s)
    if store is None:
        parser.error("the result store is off (QKOV_STORE_URL=off): nothing to fill")
    try:
        loaded = ModelRegistry(settings).get(args.model)
        heads = all_heads(loaded, args.heads)
    except QkovError as exc:
        parser.error(str(exc))
    bind(ComputeService(cache_bytes=settings.cache_bytes), None)  # tables built inside others (heads table) once
    todo = list(jobs(loaded, heads))
    computed = skipped = 0
    start = time.perf_counter()
    for analysis, params in tqdm(todo, desc=f"precompute {args.model}", unit="table", file=sys.stderr, mininterval=1.0):
        typed = params.normalised(loaded)
        key = key_text(cache_key(analysis, args.model, loaded, typed))
        if store.get(key) is not None:
            skipped += 1
            continue
        body = encode(analysis.build(loaded, typed, settings.limits))
        if body is not None:
            store.put(key, body)
            computed += 1
    took = time.perf_counter() - start
    print(f"{args.model}: {computed} tables computed, {skipped} already in the {store.name} store, {took:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
