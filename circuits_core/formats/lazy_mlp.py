"""A Llama-family model whose MLP weights are read on first use: the weight circuits (QK, OV, composition, copying,
rotary, virtual weights between attention and the embeddings) read only the attention, norm, embedding and
unembedding tensors, so a 70B model's attention circuits need its ~26 GiB of those in bf16, not its 140 GiB.

`load_llama_lazy` loads everything but the MLPs' gate/up/down projections, which stay meta placeholders of the
right shape and dtype (their shapes checked against the file headers); `DeferredMLP.attach` hands every MLP layer a
loader that, on the first read of one of its weights (model/mlp.py's __getattr__), reads that layer's three tensors
from the memory-mapped shards, applies what processing did to the MLP weights (with an RMS norm, fold_ln scales
W_gate and W_in by ln2's weight; nothing else touches them), and moves them to the model's device, once.

Supported where the processing of MLP weights is that fold or nothing: RMS norms (centring applies to LayerNorm
models only, processing.py); `lazy_mlp_supported` says so, and load_checkpoint loads eagerly otherwise.
Until every layer is read, model.parameters() and state_dict() hold the meta placeholders: the app never saves or
reprocesses a served model, and code that does must load it eagerly.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from circuits_core.errors import CheckpointError, LimitExceededError
from circuits_core.formats.llama import _Shards, load_llama, one_thread, take_gated_mlp
from circuits_core.formats.read_digest import ReadDigest
from circuits_core.formats.safetensors_file import Identity
from circuits_core.model.config import ModelConfig
from circuits_core.model.mlp import MLP
from circuits_core.model.transformer import Block, Transformer


def lazy_mlp_supported(cfg: ModelConfig) -> bool:
    """Whether the MLP weights of this (unprocessed) config can be read later: an RMS-norm model with MLPs."""
    return not cfg.attn_only and cfg.normalization_type in ("RMS", "RMSPre")


def mlp_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every layer's W_gate, W_in and W_out in `dtype` (what a deferred MLP reads when first used)."""
    if cfg.attn_only:
        return 0
    matrices = 3 if cfg.gated_mlp else 2
    return cfg.n_layers * matrices * cfg.d_model * (cfg.d_mlp or 0) * torch.empty((), dtype=dtype).element_size()


class DeferredMLP:
    """The MLP projections of a Llama-family folder, read per layer on first use (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        ln2: dict[int, Tensor],
        identities: dict[str, Identity],
        max_bytes: int | None = None,
    ):
        self.folder, self.cfg, self.dtype = folder, cfg, dtype
        self.identities = identities  # shard -> its file's identity at the load (the model's digest keys them by it)
        self.max_bytes = max_bytes  # the model budget the load was priced against (load_checkpoint's max_bytes)
        self.ln2 = ln2  # layer -> ln2's weight as stored [d_model] (fold_ln folds it into W_gate and W_in)
        self.fold = False
        self.device = torch.device("cpu")
        self.lock = threading.Lock()
        self.bytes_read = 0  # bytes of MLP weights read so far

    def attach(self, model: Transformer) -> None:
        """Give each MLP layer of `model` (built from this folder, processed) this loader."""
        self.fold = bool(model.processing.get("fold_ln")) and self.cfg.normalization_type == "RMS"
        self.device = model.device
        model.__dict__["deferred_mlp"] = self  # (not a submodule)
        for block in model.blocks:
            if isinstance(block, Block) and not model.cfg.attn_only:
                block.mlp.__dict__["loader"] = self.load

    def load(self, mlp: MLP) -> None:
        """Read layer `mlp.layer`'s weights into `mlp` (once; concurrent first uses wait for the one read)."""
        with self.lock, torch.no_grad(), one_thread():
            if not mlp.deferred:
                return
            weights: dict[str, Tensor] = {}
            shards = _Shards(self.folder, self.dtype)
            if shards.identities() != self.identities:
                raise CheckpointError(
                    f"the weight files of {self.folder.name} changed after the model was loaded (its MLP weights, "
                    "read on first use, would not be the ones its digest names): load the model again"
                )
            take_gated_mlp(shards, self.cfg, f"model.layers.{mlp.layer}", "", weights)
            for key, W in weights.items():  # ".mlp.W_gate" ...
                name = key.rsplit(".", 1)[-1]
                W = W.to(self.device)
                if self.fold and name in ("W_gate", "W_in"):
                    W.mul_(self.ln2[mlp.layer].to(self.device, W.dtype)[:, None])  # processing's RMS fold
                mlp._parameters[name] = nn.Parameter(W, requires_grad=False)
                self.bytes_read += W.numel() * W.element_size()


def weight_bytes(model: Transformer, deferred: bool) -> int:
    """Bytes of the model's weights that are read (deferred False) or still deferred placeholders (True)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.is_meta == deferred)


def check_deferred_load(model: Transformer) -> None:
    """Before an analysis that reads MLP weights: LimitExceededError when the deferred ones it would load would
    put the model over the budget it was loaded under; the message says what would be loaded, and where."""
    deferred: DeferredMLP | None = model.__dict__.get("deferred_mlp")
    if deferred is None or deferred.max_bytes is None:
        return
    pending, resident = weight_bytes(model, True), weight_bytes(model, False)
    if pending and resident + pending > deferred.max_bytes:
        layers = sum(bool(b.mlp.deferred) for b in model.blocks if isinstance(b, Block))
        raise LimitExceededError(
            f"this analysis reads the MLP weights, which are not loaded: it would load {pending / 2**30:.2f} GiB "
            f"({layers} layers, {str(deferred.dtype).removeprefix('torch.')}) onto {deferred.device}, and with the "
            f"{resident / 2**30:.2f} GiB loaded the model would be over its budget of {deferred.max_bytes / 2**30:.2f} "
            "GiB (max_model_bytes). The weight circuits (QK, OV, composition, copying, rotary) read no MLP weight"
        )


def load_llama_lazy(
    folder: Path, hf: dict[str, Any], dtype: torch.dtype, digest: ReadDigest, max_bytes: int | None = None
) -> tuple[ModelConfig, dict[str, Tensor], dict[str, str], list[Path], DeferredMLP]:
    """load_llama with the MLP projections deferred: (config, state dict with meta placeholders for them, tensor ->
    shard, weight files, the DeferredMLP that reads them later). `digest` hashes what is read and identifies the
    shards of what is not (read_digest.py); the DeferredMLP reads only from those same files."""
    cfg, state, origin, files = load_llama(folder, hf, dtype, defer_mlp=True, digest=digest)
    ln2 = {layer: state[f"blocks.{layer}.ln2.w"].clone() for layer in range(cfg.n_layers)}
    return cfg, state, origin, files, DeferredMLP(folder, cfg, dtype, ln2, dict(digest.identities), max_bytes)
