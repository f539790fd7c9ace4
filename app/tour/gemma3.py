"""The tour's chapter on Gemma-3 270M (`make gemma3`): sliding windows and QK-norm on a real model.

Two figures, each a general sentence and a sentence generated from values measured on the model (never written by
hand); tests/app/test_tour_gemma3.py recomputes every value independently and fails when a sentence stops being true:
  G1  windows: on BOS + WINDOW_PROBE random tokens (seeded), the most attention any head of a local layer puts on a
      key at least `window` tokens back (none: the window masks it), and the share of attention that the global
      layers' queries past the window put on such keys, with the head that puts the most there;
  G2  QK-norm: each head's key is divided by its RMS ρ_k before the rotation; through the embedding, layer 0's ρ_k
      over the whole vocabulary, its extremes and their tokens: the factor by which the weight-level ("bilinear")
      form of the QK circuit misweighs keys that the token-level ("cosine") form weighs exactly.
`gemma3_chapter(registry, limits)` returns the figures; without the model they say so (`available: false`).
"""

from __future__ import annotations

import torch

from app.registry import ModelRegistry
from app.settings import Limits
from app.tour.chapter import ChapterFigure, Measured, chapter_figures, load_or_reason
from app.tour.figure_data import TourFigure
from app.tour.paper_claims import FigureClaim
from app.views.shared.inputs import token_text
from circuits_core.circuits.qk_forms import QK_FORMS, token_rho
from circuits_core.cost import Cost
from circuits_core.errors import QkovError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name

GEMMA3_MODEL = "gemma3-270m"
WINDOW_PROBE = 600  # random tokens after BOS: past the 512-token window
PROBE_SEED = 0
PAPER = "https://transformer-circuits.pub/2021/framework/index.html"


def window_probe(loaded: LoadedModel) -> torch.Tensor:
    """BOS + WINDOW_PROBE token ids drawn uniformly (seeded) from the vocabulary past the first 3 (pad, eos, bos)."""
    bos = loaded.model.cfg.bos_token_id or 0
    gen = torch.Generator().manual_seed(PROBE_SEED)
    body = torch.randint(3, loaded.model.cfg.d_vocab, (WINDOW_PROBE,), generator=gen)
    return torch.cat([torch.tensor([bos]), body])[None]  # [1, 1 + WINDOW_PROBE]


class WindowsClaim(FigureClaim):
    """G1: the local layers' window and the attention the global layers put beyond it."""

    window: int  # tokens a local layer's query sees
    global_layers: list[int]
    local_max: float  # the most attention any local head puts on a key a window or more back
    global_share: float  # the global layers' mean attention there, from queries past the window
    top_head: str  # the global head that puts the most there
    top_share: float


class QKNormScalesClaim(FigureClaim):
    """G2: the spread of layer 0's key RMS ρ_k over the vocabulary, (token id, ρ_k) at each end."""

    low: tuple[int, float]
    high: tuple[int, float]
    factor: float  # ρ_k(high) / ρ_k(low)


def windows(loaded: LoadedModel) -> tuple[str, WindowsClaim]:
    model, cfg = loaded.model, loaded.model.cfg
    if cfg.window_size is None or cfg.attn_types is None:
        raise QkovError(f"{GEMMA3_MODEL} has no local layers")
    tokens = window_probe(loaded)
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(cfg.n_layers)]
    _, cache = model.run(tokens, names=lambda name: name in names)
    n, w = tokens.shape[1], cfg.window_size
    far = torch.ones(n, n, dtype=torch.bool).tril(-w)  # key at least w tokens before the query
    late = torch.arange(n) >= w  # queries that have such keys
    local_max, global_share = 0.0, {}
    for layer in range(cfg.n_layers):
        pattern = cache[names[layer]][0]  # [heads, n, n]
        mass = (pattern * far).sum(-1)[:, late]  # [heads, late queries]: attention on far keys
        if cfg.attn_types[layer] == "local":
            local_max = max(local_max, float(mass.max()))
        else:
            for h in range(cfg.n_heads):
                global_share[head_name(layer, h)] = float(mass[h].mean())
    globals_ = [layer for layer, kind in enumerate(cfg.attn_types) if kind == "global"]
    mean_share = sum(global_share.values()) / len(global_share)
    top = max(global_share, key=global_share.__getitem__)
    sentence = (
        f"{GEMMA3_MODEL} has {cfg.n_layers - len(globals_)} local layers with a {w}-token window and "
        f"{len(globals_)} global layers ({', '.join(f'L{g}' for g in globals_)}). On BOS + {WINDOW_PROBE} random "
        f"tokens, no head of a local layer puts any attention on a key {w} or more tokens back (largest: "
        f"{local_max:.1e}); the global layers' queries past position {w} put {100 * mean_share:.1f} % of their "
        f"attention there on average, {top} the most ({100 * global_share[top]:.1f} %)."
    )
    return sentence, WindowsClaim(
        window=w,
        global_layers=globals_,
        local_max=local_max,
        global_share=mean_share,
        top_head=top,
        top_share=global_share[top],
    )


def qk_norm_scales(loaded: LoadedModel) -> tuple[str, QKNormScalesClaim]:
    model = loaded.model
    if model.cfg.qk_norm is None:
        raise QkovError(f"{GEMMA3_MODEL} has no QK-norm")
    with torch.no_grad():
        rho = token_rho(model, 0, "key")[:, 0].double()  # [d_vocab]: layer 0's one key/value head
    low, high = int(rho.argmin()), int(rho.argmax())
    factor = float(rho[high] / rho[low])
    sentence = (
        f"Layer 0's key is divided by its RMS ρ_k before the rotation. Through the embedding, ρ_k ranges over the "
        f"{model.cfg.d_vocab:,} tokens from {float(rho[low]):.3g} ({token_text(loaded, low)!r}) to "
        f"{float(rho[high]):.3g} ({token_text(loaded, high)!r}), a factor of {factor:.0f}: the weight-level form "
        f"({QK_FORMS['bilinear']}) weighs these two keys {factor:.0f} times apart relative to the score, which the "
        f"token-level form ({QK_FORMS['cosine']}) reproduces exactly."
    )
    return sentence, QKNormScalesClaim(low=(low, float(rho[low])), high=(high, float(rho[high])), factor=factor)


SPECS = (
    ("G1", "Sliding windows: local and global layers", windows, "heads",
     "Gemma 3 alternates five local layers, whose heads see only the last `window` tokens, with one global layer that "
     "sees the whole context; each layer rotates with its own rope base (10,000 local, 1,000,000 global)."),
    ("G2", "QK-norm: one bilinear form between two per-token scales", qk_norm_scales, "heads/L0H0/qk?token=1",
     "With QK-norm the score of a query on a key is one fixed bilinear form W_Q Γ_q R Γ_k W_Kᵀ divided by the two "
     "tokens' RMS scales ρ_q ρ_k: token tables are exact in the cosine form, weight-level circuits are bilinear."),
)  # fmt: skip


def gemma3_chapter(registry: ModelRegistry, limits: Limits) -> list[TourFigure]:
    """G1, G2 on Gemma-3 270M; `available: false` with the reason when the model or a figure cannot be computed."""
    measures = {fid: (measure, path) for fid, _, measure, path, _ in SPECS}

    def measured(fig: ChapterFigure, loaded: LoadedModel) -> Measured:
        measure, path = measures[fig.id]
        sentence, values = measure(loaded)
        return Measured(sentence, values, f"/models/{GEMMA3_MODEL}/{path}", f"/api/v1/models/{GEMMA3_MODEL}/{path}")

    figures = [ChapterFigure(fid, title, PAPER, look_for) for fid, title, _, _, look_for in SPECS]
    return chapter_figures(registry, GEMMA3_MODEL, figures, measured)


def gemma3_chapter_cost(registry: ModelRegistry, limits: Limits) -> Cost:
    """One forward pass on BOS + WINDOW_PROBE tokens keeping every layer's pattern, and layer 0's key projection of the
    whole vocabulary; nothing when the model is missing."""
    loaded = load_or_reason(registry, GEMMA3_MODEL)
    if isinstance(loaded, str):
        return Cost(0)
    cfg = loaded.model.cfg
    n = WINDOW_PROBE + 1
    patterns = cfg.n_layers * cfg.n_heads * n * n * 4
    activations = n * max(cfg.d_vocab, 4 * (cfg.d_mlp or cfg.d_model)) * 4
    projection = cfg.d_vocab * (cfg.d_model + cfg.d_head) * 4
    return Cost(patterns + activations + projection)
