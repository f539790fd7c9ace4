"""Hugging Face Llama, Mistral and Qwen2 checkpoints, converted to TransformerLens names and shapes.

Config (`model_type` llama, mistral or qwen2; transformers' field names):
    hidden_size, num_attention_heads, num_key_value_heads (grouped-query attention), head_dim (default
    hidden_size / heads), intermediate_size, num_hidden_layers, vocab_size, max_position_embeddings,
    rms_norm_eps, hidden_act (silu: SwiGLU), tie_word_embeddings, bos_token_id; rope: `rope_parameters`
    (transformers >= 5) or `rope_scaling` + `rope_theta`, types default, linear, llama3 and yarn
    (rope_scaling.py; any other type is refused, naming it); biases: Llama `attention_bias` (q, k, v, o), Qwen2 always
    q, k, v (o none), Mistral none. Mistral's `sliding_window` masks every layer (ModelConfig.window_size, window.py).
    Qwen2's (`use_sliding_window`) never masks a sequence no longer than the window, so its context is capped at the
    window and the model stays exact.
Weights (nn.Linear stores [d_out, d_in], so each is transposed into `x @ W` form):
    model.embed_tokens.weight [V, d]                     -> embed.W_E
    model.layers.{l}.input_layernorm.weight [d]          -> blocks.{l}.ln1.w (RMS)
    self_attn.q_proj.weight [H dh, d] rows (head, e)     -> attn.W_Q [H, d, dh]   (q_proj.bias -> b_Q [H, dh])
    self_attn.k_proj / v_proj [G dh, d]                  -> attn._W_K / _W_V [G, d, dh] (G = key/value heads;
                                                            W_K / W_V when G = H)
    self_attn.o_proj.weight [d, H dh] columns (head, e)  -> attn.W_O [H, dh, d]
    post_attention_layernorm.weight                      -> ln2.w
    mlp.gate_proj / up_proj [d_mlp, d]                   -> mlp.W_gate / W_in [d, d_mlp]; down_proj -> W_out
    model.norm.weight                                    -> ln_final.w
    lm_head.weight [V, d] (absent when tied)             -> unembed.W_U [d, V] (W_E^T when tied)
Hugging Face rotates halves (rotate-half layout, rotary_adjacent_pairs False), so Q and K rows keep their
order. Reading: safetensors only (the index `model.safetensors.index.json` names the shards; every file name
is resolved inside the folder). Each tensor is read with pread into one buffer (no memory map: a file truncated or
replaced during the load is a named error, never SIGBUS), converted to the compute dtype and laid out in one copy,
so the peak is about one compute-dtype copy of the model plus one tensor's stored and converted bytes.
(safetensors' safe_open would keep every page it touched resident until the handle closes: a second, stored-dtype
copy of the model by the end of the load.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.hf import _act_fn, _bos, _config
from circuits_core.formats.read_digest import ReadDigest
from circuits_core.formats.rope_scaling import rope_fields as rope_fields  # (re-exported: llama_variants reads it)
from circuits_core.formats.rope_scaling import rope_section
from circuits_core.formats.safetensors_file import Identity, SafetensorsFile
from circuits_core.formats.statedict import folder_file, folder_listing, read_json_object
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader
from circuits_core.model.half_products import HALF_DTYPES as HALF_DTYPES  # (re-exported: checkpoint reads it)
from circuits_core.model.transformer import attn_param
from circuits_core.schedule import one_thread as one_thread  # (re-exported: the loaders run within it)

State = dict[str, Tensor]
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2")
INDEX = "model.safetensors.index.json"
_IGNORED = (".rotary_emb.inv_freq",)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SLAB_BYTES = 1 << 18  # stored bytes per slab of a transposing copy (fits the L2 cache with its output)


class _MappedFile(SafetensorsFile):
    """One .safetensors file of a Llama-family checkpoint (safetensors_file.py: bounded header, pread, the file
    checked unchanged on every read). Each tensor's stored bytes are read into one buffer, converted to the compute
    dtype and laid out in one copy, then dropped; a tensor already in its dtype and layout is kept as read (the
    buffer is its own). `digest`: each tensor's stored bytes are handed to it as they are read (read_digest.py)."""

    digest: ReadDigest | None = None

    def read(self, key: str, dtype: torch.dtype, layout: Callable[[Tensor], Tensor]) -> Tensor:
        """layout(tensor `key`) in `dtype` from the stored bytes: copied once, or the read buffer itself when that
        is already it."""
        entry = self.entries[key]
        source = _DTYPES.get(entry.get("dtype"))
        if dtype == torch.uint8 and entry.get("dtype") == "U8":  # packed bytes (MXFP4 blocks and scales), as stored
            source = torch.uint8
        if dtype == torch.float8_e4m3fn and entry.get("dtype") == "F8_E4M3":  # block-scaled FP8 (fp8.py), as stored
            source = torch.float8_e4m3fn
        if source is None:
            raise CheckpointError(
                f"{self.name}: tensor {key}: dtype {entry.get('dtype')!r} is not a float type ({', '.join(_DTYPES)})"
            )
        stored = self.stored(key, source)
        if self.digest is not None:
            self.digest.read(self.name, key, stored)
        arranged = layout(stored)
        if arranged.dtype == dtype and arranged.is_contiguous():
            return arranged  # (a view of the buffer the read filled, which nothing else holds)
        return laid_out(arranged, dtype)


def laid_out(arranged: Tensor, dtype: torch.dtype) -> Tensor:
    """A strided view (a transpose of the stored tensor) copied into a new contiguous `dtype` tensor: converted and
    laid out in one pass, slab by slab along the view's outermost stored dimension, so each slab's reads and
    writes stay in cache (one pass over a whole transposed matrix misses the cache on every other read: 2-3x
    slower on a [8192, 2048] bf16 -> float32 copy)."""
    out = torch.empty(arranged.shape, dtype=dtype)
    if arranged.dim() < 2 or arranged.is_contiguous():
        return out.copy_(arranged)
    if arranged.dtype == dtype and (pairs := _transposed_matrices(arranged, out)) is not None:
        for matrix, stored in pairs:  # no conversion: torch's blocked transpose copy (1.6x faster than slabs, bf16)
            matrix.copy_(stored)
        return out
    dim = max(range(arranged.dim()), key=arranged.stride)  # the stored tensor's rows run along this dimension
    size, step = arranged.shape[dim], max(1, SLAB_BYTES // (arranged.stride(dim) * arranged.element_size()))
    for start in range(0, size, step):
        width = min(step, size - start)
        out.narrow(dim, start, width).copy_(arranged.narrow(dim, start, width))
    return out


def _transposed_matrices(arranged: Tensor, out: Tensor) -> list[tuple[Tensor, Tensor]] | None:
    """(out matrix, arranged matrix) pairs covering `arranged` [..., n] when it is the transpose of contiguous stored
    blocks, each arranged matrix [m, n] with strides (1, m): the copy torch runs as a blocked transpose. The whole
    tensor as one matrix when it folds to one (o_proj^T as W_O [H, dh, d]), else its last two dimensions (q_proj as
    W_Q [H, d, dh]); None for any other layout."""
    n = arranged.shape[-1]
    try:
        whole = arranged.view(-1, n)
    except RuntimeError:  # not one matrix
        whole = None
    if whole is not None and whole.stride() == (1, whole.shape[0]):
        return [(out.view(-1, n), whole)]
    m = arranged.shape[-2]
    if arranged.stride(-2) != 1 or arranged.stride(-1) != m:
        return None
    return list(zip(out.view(-1, m, n), arranged.reshape(-1, m, n), strict=True))


def shard_names(folder: Path) -> list[str]:
    """The safetensors files of a Llama-family folder: the shards its index names (sorted), else model.safetensors."""
    if folder_file(folder, INDEX).is_file():
        weight_map = read_json_object(folder, INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{INDEX}: not a shard index (weight_map must map tensor names to file names)")
        return sorted(set(weight_map.values()))
    if folder_file(folder, "model.safetensors").is_file():
        return ["model.safetensors"]
    raise CheckpointError(
        f"no model.safetensors or {INDEX} (found: {folder_listing(folder)}); the Llama-family loader reads safetensors "
        f"only"
    )


class _Shards:
    """The tensors of a (sharded) safetensors checkpoint, read one at a time and converted to `dtype`."""

    def __init__(self, folder: Path, dtype: torch.dtype, digest: ReadDigest | None = None):
        self.dtype, self.digest = dtype, digest
        self.where: dict[str, str] = {}  # tensor name -> shard file name
        names = shard_names(folder)
        self.files = [folder_file(folder, name) for name in names]
        self.maps: dict[str, _MappedFile] = {}
        for name, path in zip(names, self.files, strict=True):
            if not path.is_file():
                raise CheckpointError(f"{name}: shard named by {INDEX} not found (found: {folder_listing(folder)})")
            self.maps[name] = _MappedFile(path, name)
            if digest is not None:
                self.maps[name].digest = digest
                digest.shard(self.maps[name])
            for key in self.maps[name].entries:
                if key in self.where:
                    raise CheckpointError(f"{name}: tensor {key!r} is also in {self.where[key]}")
                self.where[key] = name
        self.left = {k for k in self.where if not k.endswith(_IGNORED)}

    def has(self, key: str) -> bool:
        return key in self.where

    def take(
        self,
        key: str,
        shape: tuple[int, ...],
        layout: Callable[[Tensor], Tensor] = lambda t: t,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """layout(tensor `key`) in the compute dtype (or `dtype`: torch.uint8 reads packed bytes as stored); its
        stored shape is checked before anything is read."""
        self.check(key, shape)
        return self.maps[self.where[key]].read(key, dtype or self.dtype, layout)

    def defer(self, key: str, shape: tuple[int, ...], layout: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
        """A meta placeholder of layout(tensor `key`) (its stored shape checked, nothing read): formats/lazy_mlp.py.
        A tensor absent from the files is deferred too (a checkpoint holding only what the weight circuits read,
        such as a 70B model's attention tensors): reading it later raises check's "missing tensor" error. The
        digest is told which shard holds a deferred tensor (read_digest.py)."""
        if key in self.where:
            self.check(key, shape)
            if self.digest is not None:
                self.digest.deferred(self.maps[self.where[key]])
        return layout(torch.empty(shape, dtype=self.dtype, device="meta"))

    def stored(self, key: str) -> torch.dtype | None:
        """The dtype tensor `key` is stored in (None: absent or not a float type)."""
        entry = self.maps[self.where[key]].entries[key] if key in self.where else None
        return _DTYPES.get(str(entry.get("dtype"))) if isinstance(entry, dict) else None

    def check(self, key: str, shape: tuple[int, ...]) -> None:
        if key not in self.where:
            raise CheckpointError(f"{', '.join(self.maps)}: missing tensor {key} (expected shape {list(shape)})")
        mapped = self.maps[self.where[key]]
        given = mapped.shape(key)
        if given != shape:
            raise CheckpointError(f"{self.where[key]}: tensor {key}: expected shape {list(shape)}, given {list(given)}")
        self.left.discard(key)

    def identities(self) -> dict[str, Identity]:
        """Shard name -> the identity of its file when its header was read (safetensors_file.file_identity)."""
        return {name: mapped.identity for name, mapped in self.maps.items()}

    def finish(self) -> None:
        if self.digest is not None:
            self.digest.settle()  # every read buffer hashed before the state dict is handed on
        if self.left:
            extra = sorted(self.left)
            raise CheckpointError(
                f"{self.where[extra[0]]}: {len(extra)} tensor(s) this config has no place for: "
                f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''} (does config.json match the weights?)"
            )


def _rope(r: ConfigReader, d_head: int) -> dict[str, Any]:
    """Rope fields for ModelConfig from `rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta`."""
    return rope_fields(r, rope_section(r), d_head=d_head)


def _window(r: ConfigReader, model_type: str) -> int | None:
    """The sliding-window length when one applies (Mistral: `sliding_window`; Qwen2: `use_sliding_window`)."""
    if model_type == "qwen2" and not r.flag("use_sliding_window", default=False):
        return None
    if model_type == "llama":
        return None
    return r.integer("sliding_window", default=None, ge=1)


def head_shape(r: ConfigReader) -> tuple[int, int, int, int]:
    """(d_model, n_heads, n_kv_heads, d_head) of a Llama-layout config (head_dim defaults to d_model / n_heads)."""
    d, n_heads = r.integer("hidden_size", ge=1), r.integer("num_attention_heads", ge=1)
    n_kv = r.integer("num_key_value_heads", default=n_heads, ge=1)
    if n_heads % n_kv:
        raise CheckpointError(f"{r.source}: num_key_value_heads={n_kv} does not divide num_attention_heads={n_heads}")
    dh = r.integer("head_dim", default=None, ge=1)
    if dh is None:
        if d % n_heads:
            raise CheckpointError(f"{r.source}: hidden_size={d} is not divisible by num_attention_heads={n_heads}")
        dh = d // n_heads
    return d, n_heads, n_kv, dh


def llama_config(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a Llama / Mistral / Qwen2 config.json (refusing what the model does not implement)."""
    path = Path("config.json")
    r = ConfigReader(hf, path.name)
    model_type = r.text("model_type")
    if model_type not in LLAMA_MODEL_TYPES:
        raise CheckpointError(f"{path.name}: model_type {model_type!r} is not one of {', '.join(LLAMA_MODEL_TYPES)}")
    d, n_heads, n_kv, dh = head_shape(r)
    if r.flag("mlp_bias", default=False):
        raise CheckpointError(
            f"{path.name}: mlp_bias=true is not supported (the gated MLP has one bias, after the gate)"
        )
    attention_bias = {"llama": r.flag("attention_bias", default=False), "mistral": False, "qwen2": True}[model_type]
    d_vocab, n_ctx = r.integer("vocab_size", ge=1), r.integer("max_position_embeddings", ge=1)
    window = _window(r, model_type)
    return _config(
        path, n_layers=r.integer("num_hidden_layers", ge=0), d_model=d, n_heads=n_heads, d_head=dh,
        d_vocab=d_vocab, n_ctx=min(n_ctx, window) if window and model_type == "qwen2" else n_ctx,
        window_size=window if model_type == "mistral" else None, d_mlp=r.integer("intermediate_size", ge=1),
        attn_only=False, normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
        act_fn=_act_fn(r, "hidden_act", "silu"), eps=r.number("rms_norm_eps", default=1e-6, gt=0),
        use_bias=attention_bias, n_key_value_heads=n_kv if n_kv != n_heads else None, rotary_dim=dh,
        bos_token_id=_bos(r, d_vocab), **_rope(r, dh),
    )  # fmt: skip


def _T(W: Tensor) -> Tensor:
    """nn.Linear's [d_out, d_in] as TransformerLens's [d_in, d_out] (x @ W)."""
    return W.T


def _per_head(heads: int, dh: int, d: int | None = None) -> Callable[[Tensor], Tensor]:
    """q/k/v_proj [heads * d_head, d_model] -> [heads, d_model, d_head]; a bias (d None) -> [heads, d_head]."""
    if d is None:
        return lambda b: b.view(heads, dh)
    return lambda W: W.view(heads, dh, d).transpose(1, 2)


def _output_heads(heads: int, dh: int, d: int) -> Callable[[Tensor], Tensor]:
    """o_proj [d_model, heads * d_head] -> W_O [heads, d_head, d_model]."""
    return lambda W: W.T.view(heads, dh, d)


def stored_dtype(folder: Path) -> torch.dtype | None:
    """The dtype the embedding of a Llama-family folder is stored in (headers only; None: not a float type)."""
    return _Shards(folder, torch.float32).stored("model.embed_tokens.weight")


Loaded = tuple[ModelConfig, State, dict[str, str], list[Path]]


def single_threaded(load: Callable[..., Loaded]) -> Callable[..., Loaded]:
    """A loader run within `one_thread` (see there why)."""

    @functools.wraps(load)
    def run(folder: Path, hf: dict[str, Any], dtype: torch.dtype = torch.float32, **options: Any) -> Loaded:
        with one_thread():
            return load(folder, hf, dtype, **options)

    return run


@single_threaded
def load_llama(
    folder: Path, hf: dict[str, Any], dtype: torch.dtype, defer_mlp: bool = False, digest: ReadDigest | None = None
) -> Loaded:
    """(config, TransformerLens state dict in `dtype`, tensor -> shard file, weight files). `defer_mlp`: the MLP
    weights are meta placeholders, their shapes checked and nothing read (formats/lazy_mlp.py reads them later).
    `digest`: told every header, every tensor read and every shard holding a deferred one (read_digest.py)."""
    cfg = llama_config(hf)
    src = _Shards(folder, dtype, digest)
    d, V, d_mlp = cfg.d_model, cfg.d_vocab, cfg.d_mlp or 0
    qwen2 = hf.get("model_type") == "qwen2"
    sd: State = {"embed.W_E": src.take("model.embed_tokens.weight", (V, d))}
    for layer in range(cfg.n_layers):
        h, p = f"model.layers.{layer}", f"blocks.{layer}"
        sd[f"{p}.ln1.w"] = src.take(f"{h}.input_layernorm.weight", (d,))
        sd[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight", (d,))
        take_projections(src, cfg, h, p, sd)
        if cfg.use_bias:
            has_o_bias = not qwen2
            sd[f"{p}.attn.b_O"] = (
                src.take(f"{h}.self_attn.o_proj.bias", (d,)) if has_o_bias else torch.zeros(d, dtype=dtype)
            )
            sd[f"{p}.mlp.b_in"] = torch.zeros(d_mlp, dtype=dtype)
            sd[f"{p}.mlp.b_out"] = torch.zeros(d, dtype=dtype)
        take_gated_mlp(src, cfg, h, p, sd, defer_mlp)
    sd["ln_final.w"] = src.take("model.norm.weight", (d,))
    tied = ConfigReader(hf).flag("tie_word_embeddings", default=False)
    sd["unembed.W_U"] = take_unembedding(src, folder, sd["embed.W_E"], tied)
    if cfg.use_bias:
        sd["unembed.b_U"] = torch.zeros(V, dtype=dtype)
    src.finish()
    return cfg, sd, dict(src.where), src.files


def take_projections(src: _Shards, cfg: ModelConfig, h: str, p: str, sd: State) -> None:
    """Layer h's q/k/v_proj (and biases when cfg.use_bias) -> W_Q [H, d, dh], _W_K/_W_V [G, d, dh] (W_K / W_V when
    G = H), o_proj [d_model, H d_head] -> W_O [H, d_head, d_model], into sd under the block prefix p."""
    d, H, G, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    for x, proj, heads in (("Q", "q_proj", H), ("K", "k_proj", G), ("V", "v_proj", G)):
        # [heads * d_head, d_model] -> [heads, d_model, d_head]; bias [heads * d_head] -> [heads, d_head]
        weight, bias = f"{h}.self_attn.{proj}.weight", f"{h}.self_attn.{proj}.bias"
        sd[f"{p}.attn.{attn_param(cfg, 'W_' + x)}"] = src.take(weight, (heads * dh, d), _per_head(heads, dh, d))
        if cfg.use_bias:
            sd[f"{p}.attn.{attn_param(cfg, 'b_' + x)}"] = src.take(bias, (heads * dh,), _per_head(heads, dh))
    sd[f"{p}.attn.W_O"] = src.take(f"{h}.self_attn.o_proj.weight", (d, H * dh), _output_heads(H, dh, d))


def take_gated_mlp(src: _Shards, cfg: ModelConfig, h: str, p: str, sd: State, defer: bool = False) -> None:
    """Layer h's gate/up/down_proj -> W_gate, W_in [d_model, d_mlp], W_out [d_mlp, d_model] (`defer`: meta
    placeholders of those shapes, their stored shapes checked and nothing read: formats/lazy_mlp.py)."""
    d, d_mlp = cfg.d_model, cfg.d_mlp or 0
    take = src.defer if defer else src.take
    sd[f"{p}.mlp.W_gate"] = take(f"{h}.mlp.gate_proj.weight", (d_mlp, d), _T)
    sd[f"{p}.mlp.W_in"] = take(f"{h}.mlp.up_proj.weight", (d_mlp, d), _T)
    sd[f"{p}.mlp.W_out"] = take(f"{h}.mlp.down_proj.weight", (d, d_mlp), _T)


def take_unembedding(
    src: _Shards, folder: Path, embedding: Tensor, tied: bool, lm_head: str = "lm_head.weight"
) -> Tensor:
    """W_U [d_model, d_vocab]: lm_head transposed, or (tied, no lm_head) a copy of embedding^T, the embedding as
    stored ([d_vocab, d_model]; a stored lm_head must equal it when the config ties them)."""
    V, d = embedding.shape
    if src.has(lm_head):
        W_U = src.take(lm_head, (V, d), _T)
        if tied and not torch.equal(W_U, embedding.T):
            raise CheckpointError(
                f"{src.where[lm_head]}: {lm_head} differs from embed_tokens.weight "
                "but the config ties them (tie_word_embeddings)"
            )
        return W_U
    if tied:
        return laid_out(embedding.T, src.dtype)  # its own copy
    raise CheckpointError(f"missing tensor {lm_head} (tie_word_embeddings is false); found: {folder_listing(folder)}")
