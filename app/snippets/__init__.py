"""'Copy as Python': for a panel, the circuits_core calls that reproduce its numbers in a notebook.

Each function returns the source of a self-contained script: it loads the model folder as the server does
(load_checkpoint with the folder's processing, the server's dtype), makes the engine call the panel's analysis
makes and leaves the panel's numbers in `result` (a dict named like the fields of the panel's JSON twin).
tests/app/test_snippets.py runs every snippet and compares `result` with the JSON answer.
Token ids are written out as the page used them, so no tokenizer call can differ.

Two kinds: the functions a page's context calls with what it knows (composition, logit paths, ...: pages.py), and
the `Analysis.snippet` functions, (params, view) -> the calls after the load, which every page running that analysis
offers (declared.py and tables.py; app/routers/rendering.py PageCall.run; tests/app/test_snippets.py enumerates them).
script.py holds the load they all start with. Every snippet is importable from this package.
"""

from app.snippets.declared import (
    attention_entropy_body,
    composition_pair_body,
    direct_body,
    head_body,
    heads_body,
    path_body,
    per_head_body,
    prompt_body,
    residual_body,
    term_importance_body,
)
from app.snippets.pages import composition, composition_profile, detectors, logit_paths, ov_table, qk_score_terms
from app.snippets.script import script
from app.snippets.tables import (
    copying_all_body,
    expert_ov_body,
    positional_body,
    positivity_body,
    qk_body,
    qk_copying_offset_body,
    residual_pair_body,
    residual_usage_body,
    rotary_bands_body,
    skip_trigrams_body,
)

__all__ = [
    "attention_entropy_body",
    "term_importance_body",
    "heads_body",
    "head_body",
    "direct_body",
    "prompt_body",
    "path_body",
    "residual_body",
    "composition_pair_body",
    "per_head_body",
    "composition",
    "qk_score_terms",
    "logit_paths",
    "composition_profile",
    "detectors",
    "ov_table",
    "script",
    "qk_body",
    "skip_trigrams_body",
    "rotary_bands_body",
    "qk_copying_offset_body",
    "residual_pair_body",
    "copying_all_body",
    "expert_ov_body",
    "residual_usage_body",
    "positional_body",
    "positivity_body",
]
