"""Loading a checkpoint: a model is a folder; detect its format (detect.py), read it with that format's loader,
check it, process it, and build the model safely.

Every loader builds the whole state dict, `statedict.build_model` checks every key and shape, and only then is
the model constructed (float32 by default, float64 on request), optionally processed (processing.py:
TransformerLens's fold_ln / centring defaults). Pickle files are only read with torch.load(weights_only=True).

Choosing the processing: `load_checkpoint(process=...)`, or, for callers that pass nothing (the app), a
`qkov.json` next to config.json: `{"processing": false}` (weights as stored, e.g. to compare with
`HookedTransformer.from_pretrained_no_processing`) or `{"processing": {"center_unembed": false}}` (switches not
named stay on). What was applied, and what was skipped and why, is in `model.processing`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.formats.detect import (
    CONFIG_READERS,
    REGISTRY,
    Format,
    detect_format,
    weight_files_known_before_reading,
)
from circuits_core.formats.gguf import Defaulted, read_gguf
from circuits_core.formats.lazy_mlp import DeferredMLP, lazy_mlp_supported, load_llama_lazy, mlp_bytes
from circuits_core.formats.llama import HALF_DTYPES, LLAMA_MODEL_TYPES, llama_config, stored_dtype
from circuits_core.formats.load_watchdog import (
    LOAD_MEMORY_ALLOWANCE,
    LOAD_MEMORY_MULTIPLE,
    LoadWatchdog,
    folder_bytes,
)
from circuits_core.formats.processing import SWITCHES, ProcessingOptions, own_tensors, process_state
from circuits_core.formats.read_digest import ReadDigest
from circuits_core.formats.statedict import (
    build_model,
    check_contained,
    check_state_dict,
    files_digest,
    folder_file,
    load_bytes,
    model_config,
    read_json_object,
)
from circuits_core.formats.summary_file import load_summary
from circuits_core.formats.tokenizer import Tokenizer
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer
from circuits_core.schedule import in_background

LOAD_OPTIONS_FILE = "qkov.json"  # per-checkpoint load options (processing), next to config.json
# Files besides config.json and the weights that can change an answer, so they are part of the digest: the
# processing choice, tokenizer files (tokenizer.py), token counts (phenomena.TOKEN_COUNTS_FILE), the card.
ANSWER_FILES = (
    LOAD_OPTIONS_FILE, "tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
    "special_tokens_map.json", "token_counts.npy", "model_card.json",
)  # fmt: skip


@dataclass
class LoadedModel:
    model: Transformer  # eval mode, requires_grad False
    tokenizer: Tokenizer | None
    format: Format
    card: dict[str, Any] = field(default_factory=dict)  # model_card.json, {} when absent
    digest: str = ""  # sha256 of every answer-changing file (config, weights, ANSWER_FILES): the cache key (deferred
    # MLP weights: of what the load read and the identity of the files it defers; read_digest.py)
    path: Path = Path(".")
    defaulted: list[Defaulted] = field(default_factory=list)  # config values the file lacks, and their sources
    nonfinite: list[str] = field(default_factory=list)  # stored tensors holding NaN or inf, with their counts

    def provenance(self) -> dict[str, str]:
        """Where and in which dtypes this model's answers are computed: the device, the weights' dtype (as kept:
        bf16/fp16 when a half-precision checkpoint keeps its stored dtype), the dtype the circuits compute in, and
        whether the MLP weights are read yet (formats/lazy_mlp.py: read on first use)."""
        model = self.model
        mlps = [b.mlp for b in model.blocks if not model.cfg.attn_only]  # type: ignore[union-attr]
        deferred = sum(bool(m.deferred) for m in mlps)  # type: ignore[union-attr]
        return {
            "device": str(model.device),
            "weights_dtype": str(model.dtype).removeprefix("torch."),
            "compute_dtype": str(model.compute_dtype).removeprefix("torch."),
            "mlp_weights": "none"
            if not mlps
            else f"deferred in {deferred} of {len(mlps)} layers"
            if deferred
            else "read",
        }


def nonfinite_tensors(state: dict[str, Tensor]) -> list[str]:
    """'name (n NaN, m inf of numel)' for every stored floating-point tensor that is not finite everywhere, read
    before processing (folding a norm would spread one NaN over every weight it touches). A tensor is finite
    everywhere iff its minimum and maximum are (both propagate NaN): one reduction pass without a boolean copy,
    30x faster than isfinite(t).all() on bf16 (an 8B model's 4.5 GiB of attention and embeddings: 53 s, load ~6)."""
    out = []
    for name, t in state.items():
        if t.is_floating_point() and not t.is_meta and t.numel() and not _finite(t):  # deferred: unread
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            out.append(f"{name} ({nan} NaN, {inf} inf of {t.numel()})")
    return out


def _finite(t: Tensor) -> bool:
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def load_options(folder: str | Path) -> ProcessingOptions | None:
    """The processing chosen in the folder's `qkov.json` (`{"processing": false}` or `{"processing":
    {"fold_ln": false}}`), None without that file. Unknown switches are errors, unknown top-level keys ignored."""
    folder = Path(folder)
    if not folder_file(folder, LOAD_OPTIONS_FILE).is_file():
        return None
    data = read_json_object(folder, LOAD_OPTIONS_FILE)
    try:
        return ProcessingOptions.from_json(data.get("processing", True))
    except InvalidInputError as exc:
        raise CheckpointError(f"{LOAD_OPTIONS_FILE}: {exc}") from exc


def load_checkpoint(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    process: bool | ProcessingOptions | None = None,
    max_bytes: int | None = None,
    device: torch.device | str = "cpu",
    keep_half: bool = False,
    lazy_mlp: bool = False,
    memory_multiple: float = LOAD_MEMORY_MULTIPLE,
    memory_allowance: int = LOAD_MEMORY_ALLOWANCE,
) -> LoadedModel:
    """Load a checkpoint folder of any registered format and apply weight processing (processing.py).

    `process`: True (TransformerLens's defaults, every switch on), False (weights as stored), ProcessingOptions,
    or None: the folder's qkov.json if it has one, else True. The digest covers every file that can change an
    answer (config.json, the weight files, ANSWER_FILES present: processing choice, tokenizer, token counts,
    card) and, when they are not the defaults, the processing switches, so two folders differing in any of
    them never share a cache key. `max_bytes`: refuse (CheckpointError, before allocating) weight files or a
    model priced by its config (statedict.load_bytes) above this many bytes. Nothing is read from outside the
    folder (statedict.check_contained, folder_file).

    `device`: where the model lives; each tensor is moved there once, as it is built, before processing (which
    then runs on the device). `keep_half`: a checkpoint whose embedding is stored in bf16 or fp16 keeps that dtype
    (the circuits compute in float32: model.compute_dtype) instead of `dtype`. `lazy_mlp` (Llama-family
    safetensors): the MLP tensors are not read until an MLP weight is first used (formats/lazy_mlp.py), so the
    weight circuits read only the attention, norm, embedding and unembedding tensors; `max_bytes` then prices
    what is loaded now.

    The load runs under a watchdog (load_watchdog.py): it may add at most `memory_multiple` x the weights it loads
    (priced in `dtype`) + `memory_allowance` bytes to the process's memory, else LoadMemoryExceeded names the folder.
    """
    folder = Path(folder)
    check_contained(folder)
    # A GGUF's SentencePiece vocabulary (Gemma 3's: ~3 CPU-s, mostly Python holding the GIL) is built once the model
    # is: started when the weights were read, it stalled the rest of the load on the GIL (the non-finite check over
    # ~240 tensors 0.15 s alone, 3.0 s beside it; Gemma 3's whole load 3.2 s instead of 6.2 s, load average 4), and
    # the tokenizer was ready no sooner.
    tokenizer_gate = threading.Event()
    try:
        with LoadWatchdog(folder.name, folder_bytes(folder), memory_multiple, memory_allowance) as watch:
            return _load_watched(folder, dtype, process, max_bytes, device, keep_half, lazy_mlp, watch, tokenizer_gate)
    finally:
        tokenizer_gate.set()  # a failed load's too, or its builder waits for ever


def _load_watched(
    folder: Path,
    dtype: torch.dtype,
    process: bool | ProcessingOptions | None,
    max_bytes: int | None,
    device: torch.device | str,
    keep_half: bool,
    lazy_mlp: bool,
    watch: LoadWatchdog,
    tokenizer_gate: threading.Event,
) -> LoadedModel:
    """load_checkpoint's work, under its watchdog `watch` (told the weights' price as soon as it is known); a GGUF's
    tokenizer is built once the caller sets `tokenizer_gate`."""
    fmt = detect_format(folder)
    data = read_json_object(folder, "config.json") if fmt != "gguf" else {}
    lazy_mlp = lazy_mlp and fmt in LLAMA_MODEL_TYPES and lazy_mlp_supported(llama_config(data))
    if max_bytes is not None and not lazy_mlp:  # (a lazy load is priced by what it reads: check_price below)
        on_disk = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        if on_disk > max_bytes:
            raise CheckpointError(f"the folder holds {on_disk} bytes of files, over the limit of {max_bytes} bytes")
    if process is None:
        process = load_options(folder) or True

    def check_price(cfg: ModelConfig, without_mlp: bool = False) -> None:
        price = load_bytes(cfg, dtype) - (mlp_bytes(cfg, dtype) if without_mlp else 0)
        watch.weights(price)
        if max_bytes is not None and price > max_bytes:
            raise CheckpointError(
                f"{'the GGUF metadata' if fmt == 'gguf' else 'config.json'} describes a model of {price} bytes in "
                f"{str(dtype).removeprefix('torch.')} ({cfg.n_layers} layers, d_model={cfg.d_model}, "
                f"d_vocab={cfg.d_vocab}{', without its MLP weights' if without_mlp else ''}), over the limit of "
                f"{max_bytes} bytes"
            )

    tokenizer: Tokenizer | None = None
    defaulted: list[Defaulted] = []
    if fmt in LLAMA_MODEL_TYPES:
        if keep_half and (stored := stored_dtype(folder)) in HALF_DTYPES:
            dtype = stored  # read, laid out and kept in the stored half dtype
        check_price(llama_config(data), lazy_mlp)  # priced from config.json before any tensor is read
    elif fmt in CONFIG_READERS:
        check_price(CONFIG_READERS[fmt](data))  # priced from config.json before any tensor is read
    answer_files = [folder_file(folder, name) for name in ANSWER_FILES if folder_file(folder, name).is_file()]
    config_file = [folder_file(folder, "config.json")] if fmt != "gguf" else []
    # The digest reads every byte again (not when MLP weights are deferred: below): hash in a thread (hashlib releases
    # the GIL) while torch reads and processes.
    # GGUF and Llama-family folders name their weight files before any tensor is read, so their digest starts first
    # (on the 1B-shaped checkpoint it used to run after the 6 s read, adding 1.7 s).
    # A load that defers the MLP weights keys itself by what it reads instead (read_digest.py): the bytes of every
    # tensor it reads, hashed as they are read, and the identity of the files holding the ones it defers.
    with in_background() as background:
        deferred: DeferredMLP | None = None
        read_digest = ReadDigest(background.start) if lazy_mlp else None
        early = weight_files_known_before_reading(folder, fmt) if read_digest is None else []
        digest_job = (
            background.start(partial(files_digest, [*config_file, *early, *answer_files]))
            if early is not None
            else None
        )
        if fmt == "gguf" and early is not None:  # (early is the one .gguf file)
            files = early  # one pass over it: its metadata holds the tokenizer too; priced before dequantising
            read = read_gguf(files[0], check=check_price, tokenizer_gate=tokenizer_gate)
            cfg, state, origin, tokenizer, defaulted = read.cfg, read.state, read.origin, read.tokenizer, read.defaulted
        else:
            if read_digest is not None:
                cfg, state, origin, files, deferred = load_llama_lazy(folder, data, dtype, read_digest, max_bytes)
            else:
                cfg, state, origin, files = REGISTRY[fmt](folder, data, dtype)
            check_price(cfg, deferred is not None)
        if read_digest is None and (digest_job is None or sorted(early or []) != sorted(files)):  # (other files)
            digest_job = background.start(partial(files_digest, [*config_file, *files, *answer_files]))
        nonfinite = nonfinite_tensors(state)
        if keep_half and fmt not in LLAMA_MODEL_TYPES and state["embed.W_E"].dtype in HALF_DTYPES:
            dtype = state["embed.W_E"].dtype  # the whole model in the embedding's stored half dtype
        loaded = _build(folder, fmt, data, cfg, state, origin, dtype, process, tokenizer, torch.device(device))
        if deferred is not None:
            deferred.attach(loaded.model)
        assert digest_job is not None  # (started above in every case)
        digest = digest_job.result()  # (config and answer files only, when read_digest keys the weights)
        if read_digest is not None:
            digest = hashlib.sha256(f"{digest} read {read_digest.hexdigest()}".encode()).hexdigest()
    options = loaded.options
    if options != ProcessingOptions():
        digest = hashlib.sha256(f"{digest} {dataclasses.asdict(options)}".encode()).hexdigest()
    return LoadedModel(
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        format=fmt,
        card=loaded.card,
        digest=digest,
        path=folder,
        defaulted=defaulted,
        nonfinite=nonfinite,
    )


@dataclass
class _Built:
    model: Transformer
    tokenizer: Tokenizer | None
    card: dict[str, Any]
    options: ProcessingOptions


def _build(
    folder: Path,
    fmt: Format,
    data: dict[str, Any],
    cfg: ModelConfig,
    state: dict[str, Tensor],
    origin: dict[str, str],
    dtype: torch.dtype,
    process: bool | ProcessingOptions,
    tokenizer: Tokenizer | None = None,
    device: torch.device | None = None,
) -> _Built:
    """Tokenizer (the folder's unless the loader read one), checks, processing and the model, from a state dict
    just read."""
    if tokenizer is None:
        tokenizer = Tokenizer.from_folder(folder, bos_token_id=cfg.bos_token_id, max_tokens=cfg.d_vocab)
    if tokenizer is not None:
        if tokenizer.vocab_size > cfg.d_vocab:
            raise CheckpointError(
                f"{tokenizer.source}: tokenizer has {tokenizer.vocab_size} tokens, the model only {cfg.d_vocab}"
            )
        if cfg.bos_token_id is None and tokenizer.bos_token_id is not None:
            cfg = model_config(cfg.to_dict(), folder / "config.json", bos_token_id=tokenizer.bos_token_id)
    options = ProcessingOptions() if process is True else ProcessingOptions.none() if process is False else process
    record: dict[str, bool | str] = {s: False for s in SWITCHES}
    if fmt == "qkov" and isinstance(data.get("processing"), dict):
        record.update({k: v for k, v in data["processing"].items() if isinstance(v, bool | str)})
    # Check everything first, then process the state dict in place and build the model once (no copies).
    check_state_dict(cfg, state, origin)
    for key in list(state):  # each tensor to the device once, its host copy dropped as it goes (a deferred MLP
        value = state.pop(key)  # weight, a meta placeholder, stays meta)
        state[key] = value.to(dtype=dtype) if value.is_meta else value.to(device=device or "cpu", dtype=dtype)
    state = own_tensors(state)
    cfg = process_state(cfg, state, options, record)
    model = build_model(cfg, state, dtype=dtype, origin=origin)
    del state
    model.processing = record
    card = read_json_object(folder, "model_card.json") if folder_file(folder, "model_card.json").is_file() else {}
    card = card or load_summary(folder) or {}  # a pretrained model's measured summary, while it is current
    return _Built(model=model, tokenizer=tokenizer, card=card, options=options)
