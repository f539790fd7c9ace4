"""Gemma-3 270M (the real Q4_K_M GGUF, `make gemma3`) against transformers reading the same file, in float32.

- Tokens: qkov's tokenizer built from the file's metadata gives transformers' ids (`AutoTokenizer.from_pretrained(
  folder, gguf_file=...)`) on SAMPLE: unicode in several scripts, emoji, whitespace runs, tabs and newlines, digits,
  code, Gemma's control tokens and a literal byte-piece spelling.
- Logits: equal to <= 1e-3 on BOS + 600 tokens (past the 512-token window of the local layers).
- QK paths: on a sentence and on BOS + 600 tokens, the (query component, key component) terms of a local and a global
  head sum to the pre-softmax scores transformers' eager attention computes (q k^T times its scaling, captured inside
  it) wherever the softmax reads them.
- Behaviour: " Paris" among the top 3 after "The capital of France is"; on BOS + 40 random tokens repeated, the loss
  on the second copy is far below the first.
transformers' dequantise-and-load takes over a minute here: one copy per module, shared by the tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.prompt.qk_paths import expand_scores

FOLDER = Path(__file__).resolve().parents[2] / "models" / "gemma3-270m"
GGUF = "gemma-3-270m-q4_k_m.gguf"
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemma3")]
SAMPLE = [
    "The capital of France is",
    "Hello world  \n\n  x",
    "   leading spaces, trailing   ",
    "tabs\t\tand\r\nCRLF line ends",
    "ünïcödé Ωμέγα Привет مرحبا שלום 日本語の文章 한국어",
    "emoji 🤖🚀 and a family 👩‍👩‍👧",
    "1234567890 3.14159 1e-10 2026-11-27",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "def f(x):\n    return x ** 2  # square\n",
    "<start_of_turn>user\nhi<end_of_turn>",
    "<0x41> is a byte piece's spelling",
    "x" * 64,
]


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    if not (FOLDER / GGUF).is_file():
        pytest.fail(f"{FOLDER / GGUF} is missing: run `make gemma3` (`make test` runs it first)")
    return load_checkpoint(FOLDER, process=False)


@pytest.fixture(scope="module")
def theirs(ours: LoadedModel) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        FOLDER, gguf_file=GGUF, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_token_ids_equal_transformers_on_the_sample(ours: LoadedModel) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(FOLDER, gguf_file=GGUF)
    tok = ours.tokenizer
    assert tok is not None and tok.bos_token_id == reference.bos_token_id == 2
    for text in SAMPLE:
        ids = tok.encode(text, prepend_bos=False)
        assert ids == reference(text, add_special_tokens=False).input_ids, text
        assert tok.decode(ids) == text


def test_logits_equal_transformers_past_the_window(ours: LoadedModel, theirs: Any) -> None:
    tokens = past_the_window()
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours.model.run(tokens)[0]
    assert ours.model.cfg.window_size == 512 and tokens.shape[1] > 512
    assert (got - expected).abs().max() <= 1e-3


def past_the_window() -> torch.Tensor:
    """BOS + 600 random tokens [1, 601]: longer than the local layers' 512-token window."""
    tokens = torch.randint(3, 200_000, (1, 601), generator=torch.Generator().manual_seed(0))
    tokens[0, 0] = 2  # BOS
    return tokens


@pytest.mark.parametrize("prompt", ["sentence", "past the window"])
def test_qk_path_terms_sum_to_transformers_eager_scores(ours: LoadedModel, theirs: Any, prompt: str) -> None:
    """On a sentence and on a prompt longer than the window, every score the softmax reads (causal, and on the local
    layer within its window) is the sum of the path terms."""
    import transformers.models.gemma3.modeling_gemma3 as gemma3

    tok = ours.tokenizer
    assert tok is not None
    if prompt == "sentence":
        tokens = torch.tensor([tok.encode("When Mary and John went to the store, John gave a drink to")])
    else:
        tokens = past_the_window()
    captured: dict[int, torch.Tensor] = {}
    original = gemma3.eager_attention_forward

    def capture(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        keys = gemma3.repeat_kv(key, module.num_key_value_groups)
        captured[module.layer_idx] = (query @ keys.transpose(2, 3) * kwargs["scaling"])[0].detach()  # [H, n, n]
        return original(module, query, key, *args, **kwargs)

    gemma3.eager_attention_forward = capture
    try:
        with torch.no_grad():
            theirs(tokens)
    finally:
        gemma3.eager_attention_forward = original
    assert ours.model.cfg.attn_types is not None
    for layer in (4, 5):  # a local layer, then the first global one
        assert ours.model.cfg.attn_types[layer] == ("global" if layer == 5 else "local")
        for h in range(ours.model.cfg.n_heads):
            expansion = expand_scores(ours.model, tokens, (layer, h), keep_terms=prompt == "sentence")
            if expansion.terms is not None:
                total = expansion.terms.sum((0, 1))  # [n, n]
            else:  # 23 x 23 terms of 601 x 601 are too many to keep: their sum, by bilinearity, from the summed parts
                assert expansion.cap_factor is None  # Gemma 3 does not cap its scores
                total = expansion.q_parts.sum(0) @ expansion.k_parts.sum(0).T / expansion.scale
            read = torch.ones_like(total, dtype=torch.bool).tril()  # the scores the softmax reads
            if layer == 4:
                read &= ~torch.ones_like(read).tril(-ours.model.cfg.window_size)  # within the window: i - j < 512
            assert expansion.visible is not None and torch.equal(expansion.visible, read)
            assert (total - captured[layer][h])[read].abs().max() < 1e-3 * captured[layer][h].abs().max()


def test_paris_and_the_repeated_sequence(ours: LoadedModel) -> None:
    tok = ours.tokenizer
    assert tok is not None
    with torch.no_grad():
        logits = ours.model.run(torch.tensor([tok.encode("The capital of France is")]))[0][0, -1]
    assert tok.lookup(" Paris") in logits.topk(3).indices.tolist()
    r = torch.randint(3, 200_000, (40,), generator=torch.Generator().manual_seed(1))
    seq = torch.cat([torch.tensor([2]), r, r])[None]
    with torch.no_grad():
        logp = ours.model.run(seq)[0][0].log_softmax(-1)
    nll = -logp[:-1].gather(1, seq[0, 1:, None])[:, 0]
    first, second = nll[:40].mean().item(), nll[40:].mean().item()
    assert first > 10 and second < first / 4, (first, second)
