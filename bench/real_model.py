"""Real models as good as the toys (section `real` of `make bench`): the goals next to what a user sees.

SmolLM2-135M dropped as a bare GGUF folder (the .gguf alone, copied to a temporary folder; models/smollm2-135m/
from `make smollm2`), an empty result store, a real uvicorn on 127.0.0.1. One cold pass, in the order a reader
would go, then a repeat pass:
- load: the first request naming the model (its card), from a server started on the bare folder;
- first HTML of every sidebar page after the load (a page priced over the inline budget answers at once with
  its job's progress bar: that is its first HTML);
- complete: a page followed through its jobs (polled as the page does) until it answers 200, and its lazy panels
  (hx-trigger="load") likewise; the overview, a head page (the induction head), the composition pair of the heads
  that matter and the detectors page are timed that way;
- repeat visits: every page again, from the page cache.
Figures are single cold measurements (a cold store can be measured once per pass) and medians of the repeats,
with the load average (the machine is shared): bench figures, not timed tests.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import sized
from bench.server import REPO, Server

SMOLLM2 = REPO / "models" / "smollm2-135m"
# then the remaining pages are listed, not run (small mode: none is run beyond the four key pages)
BUDGET_S = float(os.environ.get("QKOV_BENCH_REAL_BUDGET_S", sized("1200", "0")))
MODEL = "smollm2-135m"
GOALS = {
    "load": 3.0,
    "first HTML of a sidebar page (slowest)": 3.0,
    "lazy panel complete (slowest)": 15.0,
    "overview complete": 10.0,
    "head page complete": 3.0,
    "composition pair complete": 3.0,
    "detectors page complete": 5.0,
    "repeat visit (slowest median)": 0.5,
}


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def job_id(response: httpx.Response) -> str | None:
    if response.status_code != 202:
        return None
    if response.headers.get("content-type", "").startswith("application/json"):
        return str(response.json()["id"])
    found = re.search(r'data-job="([0-9a-f]+)"', response.text)
    return found.group(1) if found else None


def complete(c: httpx.Client, url: str, headers: dict[str, str] | None = None, timeout: float = 1800) -> httpx.Response:
    """GET url, following its jobs (polling each once a second, as the page's progress bar does) until an answer."""
    end = time.monotonic() + timeout
    while True:
        r = c.get(url, headers=headers)
        jid = job_id(r)
        if jid is None:
            return r
        while time.monotonic() < end:
            state = c.get(f"/api/v1/jobs/{jid}").json()
            if state.get("state") not in ("queued", "running"):
                break
            time.sleep(0.25)
        else:
            raise RuntimeError(f"{url}: job {jid} did not finish in {timeout} s")


def lazy_panels(html: str) -> list[tuple[str, str]]:
    """(url, target id) of the panels a page loads after it is shown (hx-get with hx-trigger="load")."""
    out = []
    for tag in re.findall(r"<[^>]+hx-trigger=\"load[^\"]*\"[^>]*>", html):
        url = re.search(r'hx-get="([^"]+)"', tag)
        ident = re.search(r'id="([^"]+)"', tag)
        if url and "/jobs/" not in url.group(1):
            out.append((url.group(1).replace("&amp;", "&"), ident.group(1) if ident else ""))
    return out


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def real() -> None:
    gguf = sorted(SMOLLM2.glob("*.gguf")) if SMOLLM2.is_dir() else []
    if not gguf:
        print("  skipped: no models/smollm2-135m/*.gguf (make smollm2)")
        return
    tmp = Path(tempfile.mkdtemp(prefix="qkov-real-"))
    folder = tmp / "models" / MODEL
    folder.mkdir(parents=True)
    shutil.copy(gguf[0], folder / gguf[0].name)
    server = Server(
        tmp / "shipped-none", models_dir=str(tmp / "models"), store_url="disk", store_dir=str(tmp / "store")
    )
    figures: dict[str, float] = {}
    notes: list[str] = []

    def note(line: str) -> None:  # printed as measured too: a long cold pass on a shared machine may be cut short
        notes.append(line)
        print(f"    ({line}; load {loadavg()})", flush=True)

    note(f"load average at start {loadavg()}")
    try:
        server.wait_ready("/healthz", 300)  # the app answers; the model loads with the first request, timed below
        with httpx.Client(base_url=server.base, timeout=1800) as c:
            give_up = time.monotonic() + BUDGET_S
            figures["load"], _ = timed(lambda: c.get(f"/api/v1/models/{MODEL}").raise_for_status())
            note(f"load {figures['load']:.2f} s")
            pages = sidebar(c)
            first: dict[str, float] = {}
            for url in pages:
                first[url], r = timed(lambda url=url: c.get(url))
                note(f"first HTML {url}: {first[url]:.2f} s ({r.status_code})")
            figures["first HTML of a sidebar page (slowest)"] = max(first.values())
            heads = complete(c, f"/api/v1/models/{MODEL}/heads").json()
            prev, induction = heads["previous_token_head"], heads["induction_head"]
            note(f"heads that matter: {prev} -> {induction}")
            lazy: list[float] = []

            def page_complete(url: str) -> float:
                seconds, r = timed(lambda: complete(c, url))
                for panel, target in lazy_panels(r.text):
                    headers = {"HX-Request": "true", "HX-Target": target}
                    took, _ = timed(lambda panel=panel, headers=headers: complete(c, panel, headers))
                    lazy.append(took)
                    note(f"  lazy panel {panel}: {took:.2f} s")
                    seconds += took
                return seconds

            figures["overview complete"] = page_complete(f"/models/{MODEL}")
            note(f"overview complete {figures['overview complete']:.2f} s")
            figures["head page complete"] = page_complete(f"/models/{MODEL}/heads/{induction}")
            note(f"head page complete {figures['head page complete']:.2f} s")
            figures["composition pair complete"] = page_complete(f"/models/{MODEL}/composition/{prev}/{induction}")
            note(f"composition pair complete {figures['composition pair complete']:.2f} s")
            figures["detectors page complete"] = page_complete(f"/models/{MODEL}/detectors")
            note(f"detectors page complete {figures['detectors page complete']:.2f} s")
            key_pages = [
                f"/models/{MODEL}",
                f"/models/{MODEL}/heads/{induction}",
                f"/models/{MODEL}/composition/{prev}/{induction}",
                f"/models/{MODEL}/detectors",
            ]
            again = {
                u: statistics.median(timed(lambda u=u: c.get(u))[0] for _ in range(sized(3, 1))) for u in key_pages
            }
            figures["repeat visit (slowest median)"] = max(again.values())
            note(f"repeat visits of the four pages above: slowest median {max(again.values()):.3f} s")
            for url in pages:  # the other pages' lazy panels, while the time allowed for the section lasts
                if time.monotonic() > give_up:
                    note(f"not completed (section time budget {BUDGET_S:g} s spent): {url}")
                    continue
                took = page_complete(url)
                note(f"complete {url}: {took:.2f} s")
            figures["lazy panel complete (slowest)"] = max(lazy) if lazy else 0.0
            repeats = {
                url: statistics.median(timed(lambda url=url: c.get(url))[0] for _ in range(sized(3, 1)))
                for url in pages
            }
            figures["repeat visit (slowest median)"] = max([*repeats.values(), *again.values()])
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"  SmolLM2-135M as a bare GGUF folder, empty store, {os.cpu_count()} cores; load average now {loadavg()}")
    print(f"  {'goal':<42} {'target':>8} {'measured':>9}  met")
    for name, target in GOALS.items():
        value = figures.get(name)
        shown = f"{value:8.2f}s" if value is not None else "     n/a"
        met = "yes" if value is not None and value < target else "NO"
        print(f"  {name:<42} {target:7.1f}s {shown}  {met}")
    for line in notes:
        print(f"    {line}")


def sidebar(c: httpx.Client) -> list[str]:
    """The model's sidebar links, read from its overview page's navigation."""
    html = c.get(f"/models/{MODEL}").text
    nav = re.search(r'<nav class="sidenav"[^>]*>(.*?)</nav>', html, re.S)
    links = re.findall(rf'href="(/models/{MODEL}[^"#?]*)"', nav.group(1) if nav else html)
    seen = list(dict.fromkeys(links))
    return [u for u in seen if u.count("/") <= 4 and "/heads/" not in u][: sized(20, 3)]  # small mode: the first 3


SECTIONS = {"real": real}
