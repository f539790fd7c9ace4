"""Dense references on the conftest's tiny-2l (2 layers x 4 heads, d_model 32, shortformer positions, no
LayerNorm, no biases): a real forward pass with every activation, a head's W_V W_O as a dense float matrix, and
the comparisons the API tests make against them."""

from __future__ import annotations

import torch

from circuits_core.formats.checkpoint import LoadedModel

MiB = 1024 * 1024
API = "/api/v1/models/tiny-2l"
PROMPT = "the cat sat on the mat"


def run(tiny: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, cache = tiny.model.run(torch.tensor([ids]), names=lambda n: True)
    return logits[0], {k: v[0] for k, v in cache.items()}


def ids_of(tiny: LoadedModel, text: str = PROMPT) -> list[int]:
    return tiny.tokenizer.encode(text)


def W(tiny: LoadedModel, name: str, layer: int, h: int) -> torch.Tensor:
    return getattr(tiny.model, name)[layer, h]


def W_OV(tiny: LoadedModel, layer: int, h: int) -> torch.Tensor:
    return W(tiny, "W_V", layer, h) @ W(tiny, "W_O", layer, h)  # [d, d]


def close(got: object, want: torch.Tensor, atol: float) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float64), want.double(), atol=atol, rtol=0)


def top_entries(M: torch.Tensor, k: int) -> list[float]:
    return M.flatten().topk(k).values.tolist()
