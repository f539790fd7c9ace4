"""Measurements of the paper's phenomena on the shipped toy models (what their model cards report).

Paper sections (Elhage et al. 2021): "Zero-Layer Transformers" (the direct path W_E W_U approximates
bigram statistics), "One-Layer Attention-Only Transformers" (copying heads: positive eigenvalues of the
OV circuit; skip-trigrams), "Two-Layer Attention-Only Transformers" (induction heads built by
K-composition with a previous-token head; in-context learning).

Row-vector convention (x @ W). Token losses: losses[:, i] is the loss of predicting tokens[:, i + 1];
"position p" below is the position of the predicted token. All measurements are deterministic: the
evaluation windows are evenly spaced over the held-out stream and the random sequences are seeded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.copying_spectra import ov_copying_scores
from circuits_core.circuits.folded import head_weights
from circuits_core.errors import CheckpointError
from circuits_core.model.transformer import Transformer, next_token_losses
from circuits_core.prompt.detectors import STANDARD_BATCH, detector_scores, repeated_random_tokens, standard_tokens

REP_LEN = 50  # length T of the random sequence r in BOS + r + r
MIN_TRAIN_COUNT = 50  # training monitor only: r is drawn from tokens seen at least this often in training
STANDARD_SEED = 0
# The card's detector numbers and repeat losses use the app's standard input (heads.standard_tokens: BOS + r + r,
# r = 50 uniform random tokens, batch 10, seed 0), so the overview, the tour and the detectors page with its
# default parameters show the same numbers. The training monitor (quick_metrics) uses frequent-token repeats.
ICL_EARLY = (8, 16)  # positions [8, 16) ...
ICL_LATE = 16  # ... versus the last 16 positions of a window


# A model folder may carry the training count of every token id: `token_counts.npy`, a 1-D integer array
# [d_vocab] (numpy .npy format). The shipped toy models have it (written by training); it lets circuit tables
# be restricted to frequent tokens, since rare, under-trained tokens dominate their global top entries.
TOKEN_COUNTS_FILE = "token_counts.npy"


def load_token_counts(folder: Path, d_vocab: int) -> np.ndarray | None:
    """[d_vocab] int64 training token counts from folder/token_counts.npy; None when the file is absent."""
    path = Path(folder) / TOKEN_COUNTS_FILE
    if not path.is_file():
        return None
    try:
        counts = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{TOKEN_COUNTS_FILE}: not a readable .npy array ({type(exc).__name__})") from exc
    if counts.shape != (d_vocab,) or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise CheckpointError(
            f"{TOKEN_COUNTS_FILE}: expected [{d_vocab}] non-negative integer counts, got {counts.shape} {counts.dtype}"
        )
    return counts.astype(np.int64)


@dataclass
class EvalData:
    """What the measurements need from the corpus: held-out tokens and training token counts."""

    val: np.ndarray  # [n_val_tokens] uint16, EOT-separated held-out files
    train_counts: np.ndarray  # [d_vocab] int64
    eot: int

    def rep_vocab(self) -> Tensor:
        return torch.from_numpy(np.flatnonzero(self.train_counts >= MIN_TRAIN_COUNT)).long()

    def windows(self, n_ctx: int, n: int) -> Tensor:
        """[n, n_ctx]: EOT + (n_ctx - 1) held-out tokens from n evenly spaced offsets."""
        span = n_ctx - 1
        offsets = np.linspace(0, len(self.val) - span - 1, n).astype(np.int64)
        rows = np.stack([self.val[o : o + span] for o in offsets]).astype(np.int64)
        return torch.cat([torch.full((n, 1), self.eot, dtype=torch.long), torch.from_numpy(rows)], dim=1)

    def repeated(self, d_vocab: int, batch: int, seed: int = 0, n_ctx: int = 2 * REP_LEN + 1) -> Tensor:
        """[batch, 1 + 2T]: BOS + r + r with r from the frequent tokens, T = REP_LEN (less if n_ctx is short)."""
        t = min(REP_LEN, (n_ctx - 1) // 2)
        return repeated_random_tokens(d_vocab, t, batch, seed=seed, bos=self.eot, vocab=self.rep_vocab())

    @staticmethod
    def load(path: Path | str) -> EvalData:
        data = np.load(path)
        return EvalData(data["val"], data["train_counts"], int(data["eot"]))

    def save(self, path: Path | str) -> None:
        np.savez_compressed(path, val=self.val, train_counts=self.train_counts, eot=np.int64(self.eot))


EVAL_DATA_FILE = "eval_data.npz"  # the shipped toys' held-out corpus, beside their folders (checkpoints/)


def find_eval_data(folder: Path) -> EvalData | None:
    """The held-out corpus of a model: folder/eval_data.npz, else the parent's (the shipped toys share one)."""
    for path in (Path(folder) / EVAL_DATA_FILE, Path(folder).parent / EVAL_DATA_FILE):
        if path.is_file():
            return EvalData.load(path)
    return None


class HeldOutBigrams:
    """Counts of (current, next) token pairs in the held-out stream (pairs across a file boundary excluded)."""

    def __init__(self, data: EvalData):
        a, b = data.val[:-1].astype(np.int64), data.val[1:].astype(np.int64)
        keep = a != data.eot
        self._shift = int(max(int(data.val.max()) + 1, len(data.train_counts))).bit_length()
        keys, counts = np.unique((a[keep] << self._shift) + b[keep], return_counts=True)
        self.pairs = dict(zip(keys.tolist(), counts.tolist(), strict=True))
        self.rows = np.bincount(a[keep], minlength=len(data.train_counts))  # [V]: how often each token has a successor
        self.n_tokens = int(keep.sum())

    def count(self, a: int, b: int) -> int:
        return int(self.pairs.get((a << self._shift) + b, 0))

    def prob(self, a: int, b: int) -> float | None:
        """Held-out P(b | a); None when a never occurs with a successor."""
        rows = int(self.rows[a]) if 0 <= a < len(self.rows) else 0
        return self.count(a, b) / rows if rows else None


def token_losses(model: Transformer, tokens: Tensor, batch: int = 64) -> Tensor:
    """[b, n-1] cross-entropy of predicting tokens[:, i+1] at position i (model.run, no grad)."""
    out = []
    with torch.no_grad():
        for start in range(0, tokens.shape[0], batch):
            chunk = tokens[start : start + batch].to(model.device)
            logits = model.run(chunk)[0].float()  # [b, n, d_vocab]
            out.append(next_token_losses(logits, chunk).cpu())
    return torch.cat(out)


def text_report(model: Transformer, windows: Tensor) -> dict[str, float]:
    """Held-out loss and the in-context-learning score (late minus early loss; negative = context helps)."""
    losses = token_losses(model, windows)  # [b, n-1]; column i is position i + 1
    early = losses[:, ICL_EARLY[0] - 1 : ICL_EARLY[1] - 1].mean()
    late = losses[:, -ICL_LATE:].mean()
    return {"val_loss": float(losses.mean()), "icl_score": float(late - early)}


def repeat_losses(model: Transformer, rep_tokens: Tensor) -> dict[str, float]:
    """Mean loss on the first and second repeat of BOS + r + r (T = REP_LEN)."""
    losses = token_losses(model, rep_tokens)  # column i predicts token i + 1
    t = (rep_tokens.shape[1] - 1) // 2
    return {"rep1_loss": float(losses[:, :t].mean()), "rep2_loss": float(losses[:, t:].mean())}


def k_composition_partner(model: Transformer, layer: int, head: int) -> int:
    """The head of layer - 1 with the largest K-composition score into `head` of `layer`
    (circuits_core.circuits.composition)."""
    k = composition_scores(model, kinds=("k",), n_samples=2).raw["k"]  # [L, H (earlier), L, H (later)]
    return int(k[layer - 1, :, layer, head].argmax())


def induction_report(model: Transformer, rep_tokens: Tensor) -> dict[str, object]:
    """Best induction head of the last layer, its top K-composition partner in the layer below, and their scores."""
    with torch.no_grad():
        scores = detector_scores(model, rep_tokens.to(model.device))
    ind, prev = scores["induction"].cpu(), scores["previous_token"].cpu()  # [L, H]
    last = model.cfg.n_layers - 1
    head = int(ind[last].argmax())
    partner = k_composition_partner(model, last, head)
    return {
        "induction_head": f"L{last}H{head}",
        "induction_score": float(ind[last, head]),
        "k_composition_partner": f"L{last - 1}H{partner}",
        "partner_previous_token_score": float(prev[last - 1, partner]),
        "best_previous_token_score": float(prev[last - 1].max()),
        "induction_scores": [[round(float(v), 4) for v in row] for row in ind],
        "previous_token_scores": [[round(float(v), 4) for v in row] for row in prev],
    }


def bigram_report(model: Transformer, val: np.ndarray, eot: int) -> dict[str, float]:
    """Direct path W_E W_U vs the empirical bigram distribution P(b | a) of the held-out text.

    kl: sum_a w_a KL(P(.|a) || softmax(W_E[a] W_U)), w_a the frequency of a as the previous token;
    top1_agreement: w-weighted fraction of a where the model's argmax equals the empirical argmax (ties: any);
    unigram_kl: the same KL for the best context-free predictor (held-out unigram distribution), a baseline.
    """
    d_vocab = model.cfg.d_vocab
    a = torch.from_numpy(val[:-1].astype(np.int64))
    b = torch.from_numpy(val[1:].astype(np.int64))
    keep = a != eot  # the token after EOT starts a new file
    a, b = a[keep], b[keep]
    counts = torch.zeros(d_vocab, d_vocab, dtype=torch.float64).index_put_(
        (a, b), torch.ones(len(a), dtype=torch.float64), accumulate=True
    )
    rows = counts.sum(1)  # [V]
    seen = rows > 0
    P = counts[seen] / rows[seen, None]  # [A, V]
    w = rows[seen] / rows.sum()  # [A]
    with torch.no_grad():
        logq = torch.log_softmax(
            (model.W_E.double()[seen.nonzero().squeeze(1).to(model.device)] @ model.W_U.double()).cpu(), -1
        )
    plogp = torch.where(P > 0, P * P.clamp_min(1e-300).log(), torch.zeros_like(P)).sum(1)
    kl = float((w * (plogp - (P * logq).sum(1))).sum())
    uni = counts.sum(0) / counts.sum()
    logu = uni.clamp_min(1e-12).log()
    unigram_kl = float((w * (plogp - (P * logu).sum(1))).sum())
    model_top = logq.argmax(1)
    agree = P.gather(1, model_top[:, None]).squeeze(1) >= P.max(1).values
    return {"bigram_kl": kl, "unigram_kl": unigram_kl, "top1_agreement": float((w * agree.double()).sum())}


def skip_trigram_report(
    model: Transformer, tokenizer: Tokenizer, windows: Tensor, layer: int = 0, top: int = 12, k: int = 10
) -> dict[str, object]:
    """Skip-trigrams of each head of `layer` on held-out code.

    For every query position: source = the most-attended key (BOS excluded), boosted = the k tokens whose
    logits the source's OV direct path W_E[source] W_V W_O W_U raises most (W_O times the output norm's gain where
    the layer has one). The head copies there when the
    source token is among them (tokens compared without leading spaces, so ` name` and `name` match).
    Only positions whose source is a word token (it holds a letter) count: identifiers and keywords, the
    paper's skip-trigram examples. Reports each head's copying fraction and the best head's commonest
    (source, destination, top boosted) triples, overall and among the copying ones.
    """
    with torch.no_grad():
        _, cache = model.run(windows.to(model.device), names={f"blocks.{layer}.attn.hook_pattern"})
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].cpu()[:, :, 1:, 1:]  # [b, H, n-1, n-1] (no BOS)
        # [H, d, d], each head's W_V W_O with an output norm's gain (post-attention norm: Gemma 2/3, OLMo 2) folded
        # into W_O: the norm's per-token RMS scale is positive, so it leaves the boosted tokens' order alone
        W_OV = torch.stack(
            [W_V @ W_O for _, _, W_V, W_O in (head_weights(model, layer, h) for h in range(model.cfg.n_heads))]
        )
        W_OV = W_OV.double().cpu()
        W_E, W_U = model.W_E.double().cpu(), model.W_U.double().cpu()
    toks = windows[:, 1:]  # [b, n-1]
    src = toks.gather(1, pattern.argmax(-1).flatten(1)).view(pattern.shape[0], pattern.shape[1], -1)  # [b, H, q]
    dest = toks[:, None, :].expand_as(src)
    norm = [tokenizer.decode([i]).lstrip(" ") or " " for i in range(model.cfg.d_vocab)]
    fractions, listings = [], []
    for h in range(model.cfg.n_heads):
        s, dh = src[:, h].flatten(), dest[:, h].flatten()
        word = torch.tensor([any(c.isalpha() for c in norm[int(t)]) for t in s])
        s, dh = s[word], dh[word]
        uniq, inverse = s.unique(return_inverse=True)
        top_ids = ((W_E[uniq] @ W_OV[h]) @ W_U).topk(k, dim=-1).indices  # [u, k]
        copies_u = torch.tensor(
            [norm[int(t)] in {norm[int(x)] for x in row} for t, row in zip(uniq, top_ids, strict=True)]
        )
        fractions.append(float(copies_u[inverse].double().mean()))
        listings.append((s, dh, top_ids[inverse, 0], copies_u[inverse]))
    best = int(np.argmax(fractions))
    s, d, o, c = listings[best]

    def commonest(mask: Tensor) -> list[dict[str, object]]:
        triples: dict[tuple[int, int, int], int] = {}
        for key in zip(s[mask].tolist(), d[mask].tolist(), o[mask].tolist(), strict=True):
            triples[key] = triples.get(key, 0) + 1
        common = sorted(triples.items(), key=lambda kv: -kv[1])[:top]
        return [
            {
                "source": tokenizer.decode([a]),
                "destination": tokenizer.decode([b]),
                "boosted": tokenizer.decode([e]),
                "count": n,
            }
            for (a, b, e), n in common
        ]

    return {
        "copying_fraction_per_head": [round(f, 4) for f in fractions],
        "best_head": f"L{layer}H{best}",
        "best_head_copying_fraction": fractions[best],
        "top_k": k,
        "examples": commonest(torch.ones_like(c)),
        "copying_examples": commonest(c),
    }


# What each shipped model must show: metric -> (comparison, threshold). Tests assert these on the
# committed checkpoints; training records the step and minute at which each is first met.
THRESHOLDS: dict[int, dict[str, tuple[str, float]]] = {
    0: {"top1_agreement": (">=", 0.3), "kl_ratio": ("<=", 0.6)},
    1: {"copying_positive_fraction": (">=", 0.75), "skip_trigram_copying": (">=", 0.2)},
    2: {
        "induction_score": (">=", 0.6),
        "partner_previous_token_score": (">=", 0.5),
        "repeat_gain": (">=", 2.0),
        "icl_score": ("<", 0.0),
    },
}


def thresholds(n_layers: int, alibi: bool = False) -> dict[str, tuple[str, float]]:
    """THRESHOLDS of a model of `n_layers`. An ALiBi model's layer-0 head tells positions apart only by its slope m_h
    (on random tokens its content term cannot tell the previous key from the ones before), so its K-composition
    partner is not held to a previous-token score: the card's "alibi" section reports its attention by offset."""
    return {
        k: v for k, v in THRESHOLDS.get(n_layers, {}).items() if not (alibi and k == "partner_previous_token_score")
    }


def check_thresholds(n_layers: int, metrics: dict, detail: bool = False, alibi: bool = False) -> dict:
    """{metric: met} for the thresholds(n_layers, alibi) whose metric is in `metrics`."""
    out: dict = {}
    for key, (op, limit) in thresholds(n_layers, alibi).items():
        if key not in metrics:
            continue
        value = float(metrics[key])
        met = {">=": value >= limit, "<=": value <= limit, "<": value < limit}[op]
        out[key] = {"value": value, "op": op, "threshold": limit, "met": met} if detail else met
    return out


class _CopyingReport(TypedDict):
    ov_copying_scores: list[list[float]]  # [L][H]
    copying_positive_fraction: float


def _copying(model: Transformer) -> _CopyingReport:
    scores = ov_copying_scores(model)  # [L, H]
    return {
        "ov_copying_scores": [[round(float(v), 4) for v in row] for row in scores],
        "copying_positive_fraction": float((scores > 0).double().mean()),  # over every head of every layer
    }


def detector_input(model: Transformer) -> tuple[Tensor, dict[str, object]]:
    """The standard detector input (heads.standard_tokens, seed STANDARD_SEED) and its description for the card."""
    tokens = standard_tokens(model, seed=STANDARD_SEED)
    info = {
        "kind": "repeated_random",
        "r": "uniform over the vocabulary",
        "seq_len": (tokens.shape[1] - 1) // 2,
        "batch": STANDARD_BATCH,
        "seed": STANDARD_SEED,
        "bos": int(tokens[0, 0]),
    }
    return tokens, info


def quick_metrics(model: Transformer, data: EvalData, windows: int = 64, repeats: int = 64) -> dict[str, float]:
    """The scalar metrics tracked during training (small samples)."""
    with torch.no_grad():
        out: dict[str, float] = {
            k: round(v, 4) for k, v in text_report(model, data.windows(model.cfg.n_ctx, windows)).items()
        }
        n_layers = model.cfg.n_layers
        if n_layers == 0:
            big = bigram_report(model, data.val, data.eot)
            out.update(
                top1_agreement=round(big["top1_agreement"], 4), kl_ratio=round(big["bigram_kl"] / big["unigram_kl"], 4)
            )
        if n_layers >= 1:
            out["copying_positive_fraction"] = round(_copying(model)["copying_positive_fraction"], 4)
        if n_layers >= 2:
            rep = data.repeated(model.cfg.d_vocab, repeats, seed=1, n_ctx=model.cfg.n_ctx)
            losses = repeat_losses(model, rep)
            ind = induction_report(model, rep)
            out.update(
                rep1_loss=round(losses["rep1_loss"], 4),
                rep2_loss=round(losses["rep2_loss"], 4),
                repeat_gain=round(losses["rep1_loss"] - losses["rep2_loss"], 4),
                induction_score=round(float(ind["induction_score"]), 4),  # type: ignore[arg-type]
                partner_previous_token_score=round(float(ind["partner_previous_token_score"]), 4),  # type: ignore[arg-type]
                best_previous_token_score=round(float(ind["best_previous_token_score"]), 4),  # type: ignore[arg-type]
            )
    return out


def measure(model: Transformer, tokenizer: Tokenizer, data: EvalData, windows: int = 256) -> dict[str, object]:
    """The model card's phenomena (full samples). Keys used by THRESHOLDS are top-level scalars."""
    model = model.eval()
    with torch.no_grad():
        text = data.windows(model.cfg.n_ctx, windows)
        out: dict[str, object] = {**text_report(model, text), "eval_windows": windows}
        n_layers = model.cfg.n_layers
        if n_layers == 0:
            big = bigram_report(model, data.val, data.eot)
            out.update(big, kl_ratio=big["bigram_kl"] / big["unigram_kl"])
        if n_layers >= 1:
            out.update(_copying(model))
        if n_layers == 1:
            trig = skip_trigram_report(model, tokenizer, text[:64])
            out["skip_trigrams"] = trig
            out["skip_trigram_copying"] = trig["best_head_copying_fraction"]
        if n_layers >= 2:
            rep, info = detector_input(model)
            losses = repeat_losses(model, rep)
            out.update(losses, repeat_gain=losses["rep1_loss"] - losses["rep2_loss"], detector_input=info)
            out.update(induction_report(model, rep))
    return out
