"""Checkpoints: a model is a folder; detect its format, convert it to TransformerLens names, load it safely.

Formats (REGISTRY, keyed by `Format`):
- "qkov": qkov's own: config.json (ModelConfig fields + "format": "qkov") + model.safetensors
  (+ tokenizer.json, model_card.json). Written by `save_checkpoint`.
- "transformer_lens": config.json with HookedTransformerConfig fields + a TransformerLens state dict as
  .safetensors, .pth or .pt (buffers such as blocks.{l}.attn.mask / IGNORE are dropped).
- "gpt2", "gpt_neox": Hugging Face folders (see formats_hf.py).
- "llama", "mistral", "qwen2": Hugging Face Llama-family folders, sharded safetensors (formats_llama.py).
- "gemma2", "gemma3_text", "gemma3" (its text tower), "qwen3", "olmo2", "olmo3": the same layout with the newest
  attention (llama_variants.py: QK-norm, soft caps, sliding windows, sandwich and output norms).
- "gpt_oss": Hugging Face gpt-oss folders (sinks, mixture of experts, MXFP4 experts; gpt_oss.py).
- "mixtral", "qwen3_moe", "olmoe": the Llama layout with a mixture-of-experts MLP (moe_families.py).
- "bloom", "mpt": ALiBi models (alibi_families.py).
- "phi3": the Llama layout with fused qkv and gate/up projections, split on load (phi3.py).
- "deepseek_v2", "deepseek_v3": multi-head latent attention and DeepSeek's experts (deepseek.py).
- "gguf": a folder without config.json holding one `.gguf` file (llama.cpp, ollama), named after the folder;
  config, tensors and tokenizer all come from that file (formats_gguf.py).

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
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from safetensors.torch import save_file
from torch import Tensor

from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.formats.alibi_families import ALIBI_MODEL_TYPES, alibi_config, load_alibi
from circuits_core.formats.deepseek import DEEPSEEK_MODEL_TYPES, deepseek_config, load_deepseek
from circuits_core.formats.gguf import Defaulted, gguf_file, read_gguf
from circuits_core.formats.gpt_oss import gpt_oss_config, load_gpt_oss
from circuits_core.formats.hf import load_gpt2, load_gpt_neox
from circuits_core.formats.lazy_mlp import DeferredMLP, lazy_mlp_supported, load_llama_lazy, mlp_bytes
from circuits_core.formats.llama import (
    HALF_DTYPES,
    LLAMA_MODEL_TYPES,
    llama_config,
    load_llama,
    shard_names,
    stored_dtype,
)
from circuits_core.formats.llama_variants import REFUSED_MODEL_TYPES, VARIANT_MODEL_TYPES, load_variant, variant_config
from circuits_core.formats.load_watchdog import (
    LOAD_MEMORY_ALLOWANCE,
    LOAD_MEMORY_MULTIPLE,
    LoadWatchdog,
    folder_bytes,
)
from circuits_core.formats.moe_families import MOE_MODEL_TYPES, load_moe, moe_config
from circuits_core.formats.phi3 import load_phi3, phi3_config
from circuits_core.formats.processing import SWITCHES, ProcessingOptions, own_tensors, process_state
from circuits_core.formats.statedict import (
    PICKLE_SUFFIXES,
    build_model,
    check_contained,
    check_state_dict,
    files_digest,
    folder_file,
    folder_listing,
    load_bytes,
    read_json_object,
    read_weight_files,
)
from circuits_core.formats.summary_file import load_summary
from circuits_core.formats.tokenizer import Tokenizer
from circuits_core.model.config import ConfigReader, ModelConfig
from circuits_core.model.transformer import Transformer
from circuits_core.schedule import in_background

Format = Literal[
    "qkov", "transformer_lens", "gpt2", "gpt_neox", "gguf", "llama", "mistral", "qwen2",
    "gemma2", "gemma3_text", "gemma3", "qwen3", "olmo2", "olmo3", "gpt_oss", "mixtral", "qwen3_moe", "olmoe", "bloom",
    "mpt", "phi3", "deepseek_v2", "deepseek_v3",
]  # fmt: skip
FORMATS: tuple[str, ...] = get_args(Format)
QKOV_FORMAT_VERSION = 1
# A loader turns (folder, parsed config.json) into (config, TransformerLens state dict, key -> file, files).
# The compute dtype is passed so a loader may convert each tensor as it reads it (peak: one copy + one tensor).
Loader = Callable[
    [Path, dict[str, Any], torch.dtype], tuple[ModelConfig, dict[str, Tensor], dict[str, str], list[Path]]
]
HF_MODEL_TYPES: dict[str, Format] = {
    "gpt2": "gpt2", "gpt_neox": "gpt_neox", "llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
    "gemma2": "gemma2", "gemma3_text": "gemma3_text", "gemma3": "gemma3", "qwen3": "qwen3", "olmo2": "olmo2",
    "olmo3": "olmo3", "gpt_oss": "gpt_oss", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "olmoe": "olmoe",
    "bloom": "bloom", "mpt": "mpt", "phi3": "phi3", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3",
}  # fmt: skip
SAFETENSORS_FAMILIES = (
    *LLAMA_MODEL_TYPES,
    *VARIANT_MODEL_TYPES,
    "gpt_oss",
    *MOE_MODEL_TYPES,
    *ALIBI_MODEL_TYPES,
    "phi3",
    *DEEPSEEK_MODEL_TYPES,
)  # read shard by shard (llama.py's reader)
LOAD_OPTIONS_FILE = "qkov.json"  # per-checkpoint load options (processing), next to config.json
# Files besides config.json and the weights that can change an answer, so they are part of the digest: the
# processing choice, tokenizer files (tokenizer.py), token counts (phenomena.TOKEN_COUNTS_FILE), the card.
ANSWER_FILES = (
    LOAD_OPTIONS_FILE, "tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
    "special_tokens_map.json", "token_counts.npy", "model_card.json",
)  # fmt: skip
# Formats whose config.json prices the model before any tensor is read.
CONFIG_READERS: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    **dict.fromkeys(LLAMA_MODEL_TYPES, llama_config),
    **dict.fromkeys(VARIANT_MODEL_TYPES, variant_config),
    "gpt_oss": gpt_oss_config,
    **dict.fromkeys(MOE_MODEL_TYPES, moe_config),
    **dict.fromkeys(ALIBI_MODEL_TYPES, alibi_config),
    "phi3": phi3_config,
    **dict.fromkeys(DEEPSEEK_MODEL_TYPES, deepseek_config),
}
TL_BUFFERS = (".attn.mask", ".attn.IGNORE", ".attn.rotary_sin", ".attn.rotary_cos")


@dataclass
class LoadedModel:
    model: Transformer  # eval mode, requires_grad False
    tokenizer: Tokenizer | None
    format: Format
    card: dict[str, Any] = field(default_factory=dict)  # model_card.json, {} when absent
    digest: str = ""  # sha256 of every answer-changing file (config, weights, ANSWER_FILES): the cache key
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
    before processing (folding a norm would spread one NaN over every weight it touches)."""
    out = []
    for name, t in state.items():
        if t.is_floating_point() and not t.is_meta and not bool(torch.isfinite(t).all()):  # deferred: unread
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            out.append(f"{name} ({nan} NaN, {inf} inf of {t.numel()})")
    return out


def _model_config(data: dict[str, Any], path: Path, **overrides: Any) -> ModelConfig:
    try:
        return ModelConfig.from_dict({**data, **overrides})
    except (InvalidInputError, TypeError) as exc:
        raise CheckpointError(f"{path.name}: {exc}") from exc


def detect_format(folder: str | Path) -> Format:
    """Which loader reads this folder (from config.json); CheckpointError says what was found instead."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder.name!r} not found")
    if not folder_file(folder, "config.json").is_file():
        if gguf_file(folder) is not None:  # a folder holding one .gguf file (llama.cpp, ollama) is a model
            return "gguf"
        raise CheckpointError(f"no config.json (found: {folder_listing(folder)}); formats: {', '.join(FORMATS)}")
    data = read_json_object(folder, "config.json")
    if "model_type" in data:
        model_type = ConfigReader(data).text("model_type")
        if model_type in HF_MODEL_TYPES:
            return HF_MODEL_TYPES[model_type]
        if model_type in REFUSED_MODEL_TYPES:
            raise CheckpointError(
                f"config.json: model_type {model_type!r} is not supported yet: {REFUSED_MODEL_TYPES[model_type]}"
            )
        raise CheckpointError(
            f"config.json: unknown architecture model_type={model_type!r}; supported Hugging Face "
            f"model types: {', '.join(HF_MODEL_TYPES)} (formats: {', '.join(FORMATS)}; found: {folder_listing(folder)})"
        )
    if data.get("format") == "qkov":
        return "qkov"
    # A bare ModelConfig.to_dict() (qkov fields only; "use_bias" is not a TransformerLens field).
    qkov_fields = {f.name for f in dataclasses.fields(ModelConfig)} | {"format_version", "processing"}
    if "use_bias" in data and set(data) <= qkov_fields and folder_file(folder, "model.safetensors").is_file():
        return "qkov"
    if "n_layers" in data and "d_model" in data:
        return "transformer_lens"
    raise CheckpointError(
        f"config.json: not a known checkpoint format (formats: {', '.join(FORMATS)}); config.json has neither "
        f"model_type nor n_layers/d_model (found: {folder_listing(folder)})"
    )


def _load_qkov(
    folder: Path, data: dict[str, Any], dtype: torch.dtype
) -> tuple[ModelConfig, dict[str, Tensor], dict[str, str], list[Path]]:
    version = ConfigReader(data).integer("format_version", default=QKOV_FORMAT_VERSION, ge=1)
    if version > QKOV_FORMAT_VERSION:
        raise CheckpointError(f"config.json: format_version {version} is newer than this code ({QKOV_FORMAT_VERSION})")
    weights = folder_file(folder, "model.safetensors")
    if not weights.is_file():
        raise CheckpointError(f"qkov checkpoint without model.safetensors (found: {folder_listing(folder)})")
    state, origin = read_weight_files([weights])
    return _model_config(data, folder / "config.json"), state, origin, [weights]


def _positive(value: Any) -> bool:
    """A TransformerLens soft cap is on when it is a number > 0 (the default is -1.0)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _tl_check_supported(data: dict[str, Any], path: Path) -> None:
    """Refuse HookedTransformerConfig features this model does not implement (before reading any weights)."""
    unsupported = {
        "normalization_type": data.get("normalization_type") not in ("LN", "LNPre", "RMS", "RMSPre", None),
        "positional_embedding_type": data.get("positional_embedding_type", "standard")
        not in ("standard", "shortformer", "rotary"),
        # An RMS final norm after LayerNorm blocks (the norm family is one per model here).
        "final_rms": bool(data.get("final_rms")) and data.get("normalization_type") in ("LN", "LNPre"),
        "scale_attn_by_inverse_layer_idx": bool(data.get("scale_attn_by_inverse_layer_idx")),
        "use_local_attn": bool(data.get("use_local_attn")),
        "d_vocab_out": data.get("d_vocab_out", -1) not in (-1, None, data.get("d_vocab")),
        # Same weights, different computation: loading these would silently give other logits.
        "attention_dir": data.get("attention_dir", "causal") not in ("causal", None),
        "attn_scores_soft_cap": _positive(data.get("attn_scores_soft_cap")),
        "output_logits_soft_cap": _positive(data.get("output_logits_soft_cap")),
        "clip_qkv": data.get("clip_qkv") is not None,
        "use_logn_attn": bool(data.get("use_logn_attn")),
        "use_dynamic_ntk_rope": bool(data.get("use_dynamic_ntk_rope")),
        "use_yarn_rope": bool(data.get("use_yarn_rope")),
        # A rope scaling named on a model without rotary positions (TL would ignore it: the config is inconsistent).
        "use_NTK_by_parts_rope": bool(data.get("use_NTK_by_parts_rope"))
        and data.get("positional_embedding_type") != "rotary",
        "rotary_scaling_factor": data.get("positional_embedding_type") == "rotary"
        and data.get("rotary_scaling_factor", 1.0) not in (1, None)
        and bool(data.get("use_NTK_by_parts_rope")),
        # Extra modules (their keys would also be refused by the state-dict check, this says why).
        "use_qk_norm": bool(data.get("use_qk_norm")),
        "post_embedding_ln": bool(data.get("post_embedding_ln")),
        "use_normalization_before_and_after": bool(data.get("use_normalization_before_and_after")),
        "use_attention_sinks": bool(data.get("use_attention_sinks")),
        "num_experts": data.get("num_experts") not in (None, 0, 1),
        "load_in_4bit": bool(data.get("load_in_4bit")),
    }
    bad = [f"{k}={data.get(k)!r}" for k, flag in unsupported.items() if flag]
    if bad:
        raise CheckpointError(f"{path.name}: TransformerLens features not supported here: {', '.join(bad)}")


# TransformerLens config fields it writes as None or -1.0 to mean "unset" (absent means the same), and the value
# qkov's field then takes: one expert per token (a dense model), no soft cap, the default 1/sqrt(d_head) scale.
TL_UNSET: dict[str, tuple[tuple[Any, ...], Any]] = {
    "experts_per_token": ((None,), 1),
    "attn_scores_soft_cap": ((None, -1.0), None),
    "output_logits_soft_cap": ((None, -1.0), None),
    "attn_scale": ((None, -1.0), None),
}


def _tl_config(data: dict[str, Any], path: Path, has_bias: bool) -> ModelConfig:
    """HookedTransformerConfig fields -> ModelConfig (TL state dicts always carry biases: use_bias=True)."""
    overrides: dict[str, Any] = {"use_bias": has_bias}
    overrides.update({name: value for name, (unset, value) in TL_UNSET.items() if data.get(name) in unset})
    if data.get("use_attn_scale") is False:  # TL's switch for no scaling at all
        overrides["attn_scale"] = 1.0
    if data.get("attn_only") or not data.get("d_mlp"):
        overrides.update(attn_only=True, act_fn=None)
    if data.get("positional_embedding_type") == "rotary":  # TL's rope scalings -> rope_type (llama3, linear)
        r = ConfigReader(data, path.name)
        if r.flag("use_NTK_by_parts_rope", default=False):
            overrides.update(
                rope_type="llama3", rope_factor=r.number("NTK_by_parts_factor", gt=0),
                rope_low_freq_factor=r.number("NTK_by_parts_low_freq_factor", gt=0),
                rope_high_freq_factor=r.number("NTK_by_parts_high_freq_factor", gt=0),
                rope_original_max_position_embeddings=r.integer("NTK_original_ctx_len", ge=1),
            )  # fmt: skip
        elif r.number("rotary_scaling_factor", default=1.0, gt=0) != 1.0:
            overrides.update(rope_type="linear", rope_factor=r.number("rotary_scaling_factor", gt=0))
    return _model_config(data, path, **overrides)


def _tl_weight_files(folder: Path) -> list[Path]:
    if folder_file(folder, "model.safetensors").is_file():
        return [folder_file(folder, "model.safetensors")]
    for suffixes in ((".safetensors",), PICKLE_SUFFIXES):
        found = sorted(folder_file(folder, p.name) for p in folder.iterdir() if p.suffix in suffixes and p.is_file())
        if len(found) == 1:
            return found
        if len(found) > 1:
            raise CheckpointError(f"several weight files, which one? {', '.join(p.name for p in found)}")
    raise CheckpointError(f"no .safetensors, .pth or .pt weight file (found: {folder_listing(folder)})")


def _load_transformer_lens(
    folder: Path, data: dict[str, Any], dtype: torch.dtype
) -> tuple[ModelConfig, dict[str, Tensor], dict[str, str], list[Path]]:
    _tl_check_supported(data, folder / "config.json")
    files = _tl_weight_files(folder)
    state, origin = read_weight_files(files)
    state = {k: v for k, v in state.items() if not k.endswith(TL_BUFFERS)}
    has_bias = "unembed.b_U" in state or "blocks.0.attn.b_Q" in state
    return _tl_config(data, folder / "config.json", has_bias), state, origin, files


REGISTRY: dict[Format, Loader] = {
    "qkov": _load_qkov,
    "transformer_lens": _load_transformer_lens,
    "gpt2": load_gpt2,
    "gpt_neox": load_gpt_neox,
    "llama": load_llama,
    "mistral": load_llama,
    "qwen2": load_llama,
    "gpt_oss": load_gpt_oss,
    "mixtral": load_moe,
    "qwen3_moe": load_moe,
    "olmoe": load_moe,
    "bloom": load_alibi,
    "mpt": load_alibi,
    "phi3": load_phi3,
    "deepseek_v2": load_deepseek,
    "deepseek_v3": load_deepseek,
    "gemma2": load_variant,
    "gemma3_text": load_variant,
    "gemma3": load_variant,
    "qwen3": load_variant,
    "olmo2": load_variant,
    "olmo3": load_variant,
}


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


def weight_files_known_before_reading(folder: Path, fmt: Format) -> list[Path] | None:
    """The weight files a loader will read, where the folder names them before any tensor is read (GGUF: its one
    file; the Llama family: its shards); None for the formats whose loaders find their files while reading."""
    if fmt == "gguf":
        return [folder_file(folder, gguf_file(folder) or "")]
    if fmt in SAFETENSORS_FAMILIES:
        return [folder_file(folder, name) for name in shard_names(folder)]
    return None


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
    with LoadWatchdog(folder.name, folder_bytes(folder), memory_multiple, memory_allowance) as watch:
        return _load_watched(folder, dtype, process, max_bytes, device, keep_half, lazy_mlp, watch)


def _load_watched(
    folder: Path,
    dtype: torch.dtype,
    process: bool | ProcessingOptions | None,
    max_bytes: int | None,
    device: torch.device | str,
    keep_half: bool,
    lazy_mlp: bool,
    watch: LoadWatchdog,
) -> LoadedModel:
    """load_checkpoint's work, under its watchdog `watch` (told the weights' price as soon as it is known)."""
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
    # The digest reads every byte again: hash in a thread (hashlib releases the GIL) while torch reads and processes.
    # GGUF and Llama-family folders name their weight files before any tensor is read, so their digest starts first
    # (on the 1B-shaped checkpoint it used to run after the 6 s read, adding 1.7 s).
    with in_background() as background:
        deferred: DeferredMLP | None = None
        early = weight_files_known_before_reading(folder, fmt)
        digest_job = (
            background.start(partial(files_digest, [*config_file, *early, *answer_files]))
            if early is not None
            else None
        )
        if fmt == "gguf" and early is not None:  # (early is the one .gguf file)
            files = early  # one pass over it: its metadata holds the tokenizer too; priced before dequantising
            read = read_gguf(files[0], check=check_price)
            cfg, state, origin, tokenizer, defaulted = read.cfg, read.state, read.origin, read.tokenizer, read.defaulted
        else:
            if fmt in LLAMA_MODEL_TYPES and lazy_mlp:
                cfg, state, origin, files, deferred = load_llama_lazy(folder, data, dtype, max_bytes)
            else:
                cfg, state, origin, files = REGISTRY[fmt](folder, data, dtype)
            check_price(cfg, deferred is not None)
        if digest_job is None or sorted(early or []) != sorted(files):  # (a loader read other files)
            digest_job = background.start(partial(files_digest, [*config_file, *files, *answer_files]))
        nonfinite = nonfinite_tensors(state)
        if keep_half and fmt not in LLAMA_MODEL_TYPES and state["embed.W_E"].dtype in HALF_DTYPES:
            dtype = state["embed.W_E"].dtype  # the whole model in the embedding's stored half dtype
        loaded = _build(folder, fmt, data, cfg, state, origin, dtype, process, tokenizer, torch.device(device))
        if deferred is not None:
            deferred.attach(loaded.model)
        digest = digest_job.result()
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
            cfg = _model_config(cfg.to_dict(), folder / "config.json", bos_token_id=tokenizer.bos_token_id)
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


def save_checkpoint(
    model: Transformer,
    folder: str | Path,
    tokenizer_json: str | Tokenizer | None = None,
    card: dict[str, Any] | None = None,
) -> Path:
    """Write qkov's format: config.json + model.safetensors (+ tokenizer.json, model_card.json)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    processing = {k: v for k, v in model.processing.items() if k in SWITCHES or k.endswith("_skipped")}
    config = {"format": "qkov", "format_version": QKOV_FORMAT_VERSION, **model.cfg.to_dict(), "processing": processing}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_json is not None:
        text = tokenizer_json.to_json() if isinstance(tokenizer_json, Tokenizer) else tokenizer_json
        (folder / "tokenizer.json").write_text(text)
    if card is not None:
        (folder / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    return folder
