"""The families beyond Llama (sections `families-load` and `moe-heads` of `python -m bench`).

families-load: a Llama-, a Mixtral-, a gpt-oss- and a DeepSeek-V3-layout checkpoint of about the same size on disk
    (random weights, written by transformers' save_pretrained in float32), each loaded by load_checkpoint
    (process=True, float32): seconds per GB on disk, median of 3, the four in one run.
gguf-load: the same for GGUF files as llama.cpp's converter writes them (float32 tensors, written by the GGUF loader
    tests' writers): a Llama, a DeepSeek-V3 (deepseek2) and an MPT file of about the same size, in one run.
moe-heads: the heads table (prompt.head_table: detector pass + full-circuit spectra) of a mixture-of-experts model
    (8 experts of d_mlp 256, top 2) against the dense model with the same active MLP width (d_mlp 512) and the same
    attention, both random qkov models, the same tokens.
The machine is shared: figures are indicative; the load average is printed by `python -m bench`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from bench import median_time, sized

D, LAYERS, HEADS, KV, VOCAB = sized((512, 4, 8, 4, 8192), (64, 2, 4, 2, 512))
F = sized(2048, 64)  # an expert's MLP width (a dense MLP is 4 F)
TOKENS = sized((16, 128), (2, 24))  # the heads table's batch


def _write(kind: str, folder: Path) -> int:
    import transformers

    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV, max_position_embeddings=2048)  # fmt: skip
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, intermediate_size=4 * F))
    elif kind == "mixtral":
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**common, intermediate_size=F, num_local_experts=4, num_experts_per_tok=2)
        )
    elif kind == "deepseek_v3":  # latent attention, a dense first layer, then 4 experts + a shared one
        model = transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(
                **{**common, "num_key_value_heads": HEADS},
                intermediate_size=4 * F,
                moe_intermediate_size=F,
                n_routed_experts=4,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                n_group=2,
                topk_group=1,
                q_lora_rank=192,
                kv_lora_rank=128,
                qk_nope_head_dim=64,
                qk_rope_head_dim=32,
                v_head_dim=64,
            )  # fmt: skip
        )
    else:
        model = transformers.GptOssForCausalLM(
            transformers.GptOssConfig(
                **common,
                head_dim=64,
                intermediate_size=F,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=128,
            )  # fmt: skip
        )
    model.save_pretrained(folder)
    return sum(p.stat().st_size for p in folder.iterdir())


def families_load() -> None:
    from circuits_core.formats.checkpoint import load_checkpoint

    with tempfile.TemporaryDirectory(prefix="qkov-bench-families-") as tmp:
        for kind in ("llama", "mixtral", "gpt_oss", "deepseek_v3"):
            folder = Path(tmp) / kind
            size = _write(kind, folder)
            seconds, _ = median_time(lambda f=folder: load_checkpoint(f, dtype=torch.float32), repeats=3)
            print(
                f"  load {kind:8s} {size / 1e9:5.2f} GB on disk: {seconds:6.2f} s, {seconds / (size / 1e9):5.2f} s/GB"
            )


def _write_gguf(kind: str, folder: Path) -> int:
    import transformers

    from tests.core.gguf_writing import write_deepseek, write_gguf, write_mpt

    folder.mkdir()
    path = folder / "model.gguf"
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  max_position_embeddings=2048, rms_norm_eps=1e-5)  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if kind == "llama":
        config = transformers.LlamaConfig(**common, num_key_value_heads=KV, intermediate_size=4 * F,
                                          rope_parameters=rope)  # fmt: skip
        write_gguf(transformers.LlamaForCausalLM(config), "llama", path)
    elif kind == "deepseek2":  # the families-load DeepSeek-V3 shape
        config = transformers.DeepseekV3Config(
            **common, num_key_value_heads=HEADS, intermediate_size=4 * F, moe_intermediate_size=F,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2,
            topk_group=1, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            rope_parameters=rope,
        )  # fmt: skip
        write_deepseek(transformers.DeepseekV3ForCausalLM(config), path, "sigmoid", legacy=False)
    else:  # MPT: d_model 2 D, so that its 4 d_model MLP matches the others' size
        config = transformers.MptConfig(
            vocab_size=VOCAB, d_model=2 * D, n_heads=HEADS, n_layers=LAYERS, max_seq_len=2048
        )
        write_mpt(transformers.MptForCausalLM(config), path)
    return path.stat().st_size


def gguf_load() -> None:
    from circuits_core.formats.checkpoint import load_checkpoint

    with tempfile.TemporaryDirectory(prefix="qkov-bench-gguf-") as tmp:
        for kind in ("llama", "deepseek2", "mpt"):
            folder = Path(tmp) / kind
            size = _write_gguf(kind, folder)
            seconds, _ = median_time(lambda f=folder: load_checkpoint(f, dtype=torch.float32), repeats=3)
            print(f"  load GGUF {kind:9s} {size / 1e9:5.2f} GB: {seconds:6.2f} s, {seconds / (size / 1e9):5.2f} s/GB")


def moe_heads() -> None:
    from circuits_core.model.config import ModelConfig
    from circuits_core.model.transformer import random_model
    from circuits_core.prompt.head_table import head_table

    base = dict(n_layers=LAYERS, d_model=D, n_heads=HEADS, d_head=64, d_vocab=VOCAB, n_ctx=512, attn_only=False,
                normalization_type="RMS", positional_embedding_type="rotary", act_fn="silu", gated_mlp=True,
                n_key_value_heads=KV)  # fmt: skip
    dense = random_model(ModelConfig(**base, d_mlp=F // 4))
    moe = random_model(ModelConfig(**base, d_mlp=F // 8, num_experts=8, experts_per_token=2))
    tokens = torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(0))
    for name, model in (("dense d_mlp 512", dense), ("MoE 8 x 256, top 2", moe)):
        seconds, _ = median_time(lambda m=model: head_table(m, tokens), repeats=3)
        print(f"  heads table, {name:20s}: {seconds:6.2f} s ({TOKENS[0]} x {TOKENS[1]} tokens)")


SECTIONS = {"families-load": families_load, "gguf-load": gguf_load, "moe-heads": moe_heads}
