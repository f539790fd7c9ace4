"""Each residual-stream writer's and reader's map as a chain of factors, and the products and norms of chains.

Paper section: "The Residual Stream as a Communication Channel" (Elhage et al. 2021; docs/maths.md §2.1). Row-vector
(TransformerLens) convention, x @ W. The components are named in stream_components.py; here each becomes the factors
whose product is its map, never formed densely unless asked:

    writer   W_w [n_in, d_model]                reader   W_r [d_model, n_out]
    embed    [EMBED] (W_E_eff, applied last)     Q        [W_Q, R(offset) W_K^T]
    pos      [W_pos]                             K        [W_K, R(offset)^T W_Q^T]
    head     [W_V, W_O]                          V        [W_V, W_O]
    mlp      [W_out] (chosen neurons' rows)      in/gate/up/router   [W_in | W_gate | W_router] (chosen columns)
                                                 unembed  [W_U]

A virtual weight W_w W_r is the chain of both; `factored` splits it at its smallest inner dimension, and
`chain_norm` takes ||product||_F from the factors' Grams in float64. Weights are used as loaded (gains folded,
folded.py; GQA heads read their group's W_K / W_V).
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits import rotary
from circuits_core.circuits.copying_spectra import embed_gram
from circuits_core.circuits.embedding import embed_eff, embed_eff_matmul
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.folded import head_weights, mlp_output_weight
from circuits_core.circuits.stream_components import SHARED, Reader, Writer
from circuits_core.errors import InvalidInputError
from circuits_core.model.moe import MoE
from circuits_core.model.transformer import Block, Transformer

EMBED = "embed"  # marks W_E_eff in a factor chain (never materialised unless it is a factor itself)
Chain = list[Tensor | str]


def block(model: Transformer, layer: int) -> Block:
    """Block `layer` (typed)."""
    block = model.blocks[layer]
    assert isinstance(block, Block)
    return block


def rotation(model: Transformer, offset: int, layer: int | None = None) -> Tensor:
    """R(offset) [d_head, d_head] with W_QK(offset) = W_Q R(offset) W_K^T (rotary.rotation with layer `layer`'s rope;
    identity otherwise)."""
    if model.cfg.positional_embedding_type != "rotary":
        if offset:
            raise InvalidInputError(
                f"offset applies to rotary models only; this one has {model.cfg.positional_embedding_type!r} positions"
            )
        return torch.eye(model.cfg.d_head, dtype=model.dtype, device=model.device)
    return rotary.rotation(model, [offset], dtype=model.dtype, layer=layer)[0]


def mlp_input(model: Transformer, reader: Reader) -> Tensor:
    """The MLP input a reader names [d, d_mlp] (an expert's; the router's W_router [d, n_experts])."""
    mlp = block(model, reader.layer).mlp
    if reader.role == "router":
        assert isinstance(mlp, MoE)  # (parse_reader: only a mixture of experts has one)
        return mlp.W_router
    if reader.expert == SHARED:
        assert isinstance(mlp, MoE)
        W: Tensor = mlp.W_shared_gate if reader.role == "gate" else mlp.W_shared_in  # [d, d_shared]
    else:
        W = mlp.W_gate if reader.role == "gate" else mlp.W_in  # [d, d_mlp] (or [n_experts, d, d_mlp])
        W = W[reader.expert] if reader.expert >= 0 else W
    return W if reader.neurons is None else W[:, list(reader.neurons)]


def mlp_output(model: Transformer, writer: Writer) -> Tensor:
    """The MLP output a writer names, W_out [d_mlp, d] (an expert's), or the chosen neurons' rows."""
    if writer.expert == SHARED:
        mlp = block(model, writer.layer).mlp
        assert isinstance(mlp, MoE)
        W_out: Tensor = mlp.W_shared_out  # [d_shared, d] (DeepSeek has no output norms)
    else:
        W_out = mlp_output_weight(model, writer.layer)  # [d_mlp, d] (or [n_experts, d_mlp, d]), output gain folded
        W_out = W_out[writer.expert] if writer.expert >= 0 else W_out
    return W_out if writer.neurons is None else W_out[list(writer.neurons)]


def writer_chain(model: Transformer, writer: Writer) -> Chain:
    """Factors whose product is W_w [n_in, d_model] (EMBED stands for W_E_eff)."""
    if writer.kind == "embed":
        return [EMBED]
    if writer.kind == "pos":
        assert model.W_pos is not None
        return [model.W_pos]
    if writer.kind == "head":
        _, _, W_V, W_O = head_weights(model, writer.layer, writer.head)
        return [W_V, W_O]
    return [mlp_output(model, writer)]


def reader_chain(model: Transformer, reader: Reader, offset: int = 0) -> Chain:
    """Factors whose product is W_r [d_model, n_out]."""
    if reader.role == "unembed":
        return [model.W_U]
    if reader.role in ("in", "gate", "up", "router"):
        return [mlp_input(model, reader)]
    W_Q, W_K, W_V, W_O = head_weights(model, reader.layer, reader.head)  # gains folded (folded.py)
    R = rotation(model, offset, reader.layer)
    if reader.role == "Q":
        return [W_Q, R @ W_K.T]
    if reader.role == "K":
        return [W_K, R.T @ W_Q.T]
    return [W_V, W_O]


def _width(model: Transformer, factor: Tensor | str, side: int) -> int:
    if isinstance(factor, str):
        return model.cfg.d_vocab if side == 0 else model.cfg.d_model
    return int(factor.shape[side])


def _product(model: Transformer, chain: Chain) -> Tensor:
    """The product of a chain, smallest factors first; a leading EMBED is applied last (in row chunks)."""
    rest = [f for f in chain if isinstance(f, Tensor)]
    if isinstance(chain[0], str):
        return embed_eff(model) if not rest else embed_eff_matmul(model, _matmul_all(rest))
    return _matmul_all(rest)


def _matmul_all(factors: list[Tensor]) -> Tensor:
    out = factors[-1]
    for f in reversed(factors[:-1]):
        out = f @ out
    return out


def factored(model: Transformer, chain: Chain) -> FactoredMatrix:
    """The chain's product as a FactoredMatrix split at its smallest inner dimension."""
    if len(chain) < 2:
        raise InvalidInputError("a factored product needs at least two factors")
    inner = [_width(model, f, 1) for f in chain[:-1]]
    split = min(range(len(inner)), key=lambda i: (inner[i], -i)) + 1
    left, right = chain[:split], chain[split:]
    assert all(isinstance(f, Tensor) for f in right)
    return FactoredMatrix(_product(model, left), _matmul_all(right))  # type: ignore[arg-type]


def chain_norm(model: Transformer, chain: Chain) -> Tensor:
    """||product||_F from the factors: <A^T A, B B^T> for two factors, accumulated in float64 (a float32 sum over
    W_U's d_model x d_vocab entries drifts by ~0.2 %)."""
    if len(chain) == 1:
        if isinstance(chain[0], str):
            return embed_gram(model).double().trace().sqrt()
        return _norm64(chain[0])
    A, B = chain
    assert isinstance(A, Tensor) and isinstance(B, Tensor)
    A, B = A.double(), B.double()  # at most d_model x d_head or one MLP's weights
    return ((A.T @ A) * (B @ B.T)).sum().clamp_min(0).sqrt()


def _norm64(W: Tensor, numbers: int = 1 << 20) -> Tensor:
    """||W||_F accumulated in float64, in slices of about `numbers` entries along W's longest side (no float64 copy
    of W_U, which may be a transposed view)."""
    dim = max(range(W.dim()), key=lambda i: W.shape[i])
    step = max(1, numbers * W.shape[dim] // max(W.numel(), 1))
    sq = torch.zeros((), dtype=torch.float64, device=W.device)
    for i in range(0, W.shape[dim], step):
        sq += W.narrow(dim, i, min(step, W.shape[dim] - i)).double().pow(2).sum()
    return sq.sqrt()
