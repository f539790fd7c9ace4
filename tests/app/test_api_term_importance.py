"""API of term importance: the loss with each order of path terms and with each head ablated, against dense float64
reruns of the conftest's tiny-2l (tests/app/tiny_dense.py) and the engine's order reruns on an MLP model, and its
refusals as problem+json."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.prompt.ablation import head_ablation, lm_loss, order_logits
from circuits_core.prompt.paths import expand_logits
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer
from tests.app.tiny_dense import API, PROMPT, W_OV, MiB, W, close, ids_of, run


# -- term importance ---------------------------------------------------------------------------------------
def test_term_importance_losses(roomy: TestClient, tiny: LoadedModel) -> None:
    ids = ids_of(tiny)
    logits, cache = run(tiny, ids)
    body = roomy.get(f"{API}/term-importance", params={"prompt": PROMPT}).json()
    target = torch.tensor(ids[1:])

    def loss(lg: torch.Tensor) -> float:
        return float(F.cross_entropy(lg[:-1], target))

    model = tiny.model
    X0 = cache["hook_embed"]
    A = [cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(2)]
    first = [sum(A[layer][h] @ X0 @ W_OV(tiny, layer, h) for h in range(4)) for layer in range(2)]
    assert body["text_source"] == "prompt" and [t["id"] for t in body["tokens"]] == ids
    assert body["clean_loss"] == pytest.approx(loss(logits), abs=1e-9)
    want = [loss(X0 @ model.W_U), loss((X0 + first[0] + first[1]) @ model.W_U), loss(logits)]
    assert body["loss_by_order"] == pytest.approx(want, abs=1e-9)
    assert body["marginal_by_order"] == pytest.approx([want[0] - want[1], want[1] - want[2]], abs=1e-9)
    assert body["first_order_by_layer"] == pytest.approx(
        [want[0] - loss((X0 + f) @ model.W_U) for f in first], abs=1e-9
    )
    # a last-layer head has nothing downstream: ablating it removes exactly its result vector
    result = cache["blocks.1.attn.hook_pattern"][1] @ cache["blocks.1.attn.hook_v"][:, 1] @ W(tiny, "W_O", 1, 1)
    ablated = next(h for h in body["heads"] if h["head"] == "L1H1")
    assert ablated["loss_change"] == pytest.approx(loss(logits - result @ model.W_U) - loss(logits), abs=1e-9)
    assert len(body["heads"]) == 8


def test_term_importance_default_text_and_refusals(roomy: TestClient, tight: TestClient) -> None:
    body = roomy.get(f"{API}/term-importance").json()
    assert body["text_source"] == "builtin" and len(body["tokens"]) == LIMITS.max_prompt_tokens  # clipped to the limit
    assert_problem(roomy.get(f"{API}/term-importance", params={"tokens": "5"}), 422, "at least 2 tokens")
    assert_problem(tight.get(f"{API}/term-importance"), 422, "bytes", "budget")


def test_term_importance_on_an_mlp_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    """MLP models are served (no refusal): each MLP's clean output is an order-0 source kept in every rerun, the
    numbers are the engine's (order reruns, head ablations) and the order-n_layers loss is the real clean loss."""
    root = tmp_path_factory.mktemp("mlp")
    tok = train_tokenizer()
    cfg = ModelConfig(
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_head=8,
        d_vocab=tok.get_vocab_size(),
        n_ctx=32,
        attn_only=False,
        d_mlp=32,
        act_fn="gelu_new",
        normalization_type="LN",
        positional_embedding_type="standard",
    )
    save_qkov(root / "tiny-mlp", cfg, tok, seed=5)
    settings = Settings(
        shipped_dir=root, dtype="float64", limits=LIMITS.model_copy(update={"matrix_budget_bytes": 16 * MiB})
    )
    with TestClient(create_app(settings)) as c:
        response = c.get("/api/v1/models/tiny-mlp/term-importance", params={"prompt": PROMPT})
    assert response.status_code == 200, response.text
    body = response.json()
    loaded = load_checkpoint(root / "tiny-mlp", dtype=torch.float64)
    seq = torch.tensor([[t["id"] for t in body["tokens"]]])
    per_order = order_logits(loaded.model, seq)
    losses = [float(lm_loss(lg, seq)) for lg in per_order]
    assert body["loss_by_order"] == pytest.approx(losses, abs=1e-9)
    assert body["clean_loss"] == pytest.approx(float(lm_loss(loaded.model.run(seq)[0], seq)), abs=1e-9) == losses[-1]
    assert body["marginal_by_order"] == pytest.approx([losses[0] - losses[1], losses[1] - losses[2]], abs=1e-9)
    # the order-0 rerun keeps the MLPs: it is the order-0 total of the path expansion, MLP sources included
    exp = expand_logits(loaded.model, seq[0], 3, positions=None, max_order=0)
    assert any(p == ("mlp:L1",) for p in exp.paths)
    assert close(per_order[0][0, :, 3].tolist(), exp.values.sum(0), 1e-9)
    heads = head_ablation(loaded.model, seq)
    assert [h["loss_change"] for h in body["heads"]] == pytest.approx(heads.flatten().tolist(), abs=1e-9)
