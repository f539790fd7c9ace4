"""No dead code in the engine, the app or the benchmarks: every function, method, class, property and import that
vulture finds no use of is listed below with what uses it (a route, a notebook, a generated snippet, torch).

vulture reads the Python source only, so the names its readers reach otherwise are listed here: FastAPI routes and
pydantic hooks (by their decorators), nn.Module.forward (torch calls it), the README's notebook API ("From a
notebook"), names that code qkov generates calls, and a child process's entry point. Schema fields, TypedDict keys
and dataclass fields are not checked (templates and JSON read them). A new function that nothing calls fails here:
delete it, or call it.
"""

from __future__ import annotations

from pathlib import Path

import vulture

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("app", "circuits_core", "bench")
KINDS = ("function", "method", "class", "property", "import", "unreachable_code")
# FastAPI routes and pydantic's hooks: the framework calls them.
DECORATORS = ["@router.get", "@router.post", "@app.get", "@app.post", "@field_validator", "@model_serializer"]
# nn.Module.forward: torch calls it through Module.__call__.
NAMES = ["forward"]
# (module, name) -> who uses it.
USED_ELSEWHERE = {
    ("bench/big_models.py", "measure_8b"): "the child process bench/big_models.py starts with `python -c`",
    ("app/ratelimit.py", "backend"): "tests/app/test_store.py reads which store a limiter counts in",
    ("circuits_core/circuits/ov_row_ranks.py", "row_ranks"): "the OV table's snippet (app/snippets/tables.py)",
    ("circuits_core/formats/processing.py", "process_weights"): "the README's notebook API (and the tests' fixtures)",
    ("circuits_core/circuits/embedding.py", "embed_pos_basis"): "the README's notebook API",
    ("circuits_core/circuits/factored.py", "svd_cost"): "the README's notebook API",
    ("circuits_core/circuits/factored.py", "topk_col"): "the README's notebook API",
    ("circuits_core/circuits/latent_circuits.py", "rotary_term"): "the README's notebook API",
    ("circuits_core/circuits/rotary.py", "qk_copying_scores_at"): "the README's notebook API",
    ("circuits_core/prompt/ablation.py", "order_logits"): "the README's notebook API",
    ("circuits_core/prompt/ablation.py", "head_ablation"): "the README's notebook API",
    ("circuits_core/prompt/qk_paths.py", "circuit_positivity"): "the README's notebook API",
    ("circuits_core/prompt/virtual.py", "virtual_ov"): "the README's notebook API",
    ("circuits_core/prompt/virtual.py", "virtual_copying_scores"): "the README's notebook API",
    ("circuits_core/prompt/virtual.py", "virtual_pattern"): "the README's notebook API",
    ("circuits_core/prompt/virtual.py", "rank_by_v_composition"): "the README's notebook API",
    ("circuits_core/prompt/virtual.py", "rank_by_contribution"): "the README's notebook API",
}


def unused() -> set[tuple[str, str]]:
    """(module, name) of every function, method, class, property or import vulture finds no use of."""
    found = vulture.Vulture(ignore_decorators=DECORATORS, ignore_names=NAMES)
    found.scavenge([str(ROOT / part) for part in CHECKED])
    return {
        (Path(item.filename).resolve().relative_to(ROOT).as_posix(), item.name)
        for item in found.get_unused_code(min_confidence=60)
        if item.typ in KINDS
    }


def test_nothing_in_the_engine_app_or_benchmarks_is_dead() -> None:
    dead = unused() - USED_ELSEWHERE.keys()
    assert not dead, f"no caller (delete it, or list who uses it in USED_ELSEWHERE): {sorted(dead)}"


def test_the_notebook_api_listed_here_is_the_readmes() -> None:
    """Each name kept for notebooks is in the README's notebook section, and each is still unused by qkov itself (a
    name the app starts calling leaves the list)."""
    readme = (ROOT / "README.md").read_text()
    notebook = readme[readme.index("## From a notebook") :]
    kept = {key for key, why in USED_ELSEWHERE.items() if why.startswith("the README's notebook API")}
    assert all(name in notebook for _, name in kept), [name for _, name in kept if name not in notebook]
    assert not USED_ELSEWHERE.keys() - unused(), sorted(USED_ELSEWHERE.keys() - unused())
