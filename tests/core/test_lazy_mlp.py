"""Big checkpoints without a full copy: a Llama checkpoint that transformers writes (bf16, sharded with an index),
loaded with its MLP weights deferred (formats/lazy_mlp.py).

Counted, not assumed: every tensor the loader materialises from the memory-mapped shards goes through
`_MappedFile.read`, so a wrapper sums the stored bytes of each tensor read. A lazy load reads exactly the
attention, norm, embedding and unembedding tensors (the bytes in the shards' headers of those names); the weight
circuits (OV and QK copying, composition, virtual weights of attention and the embeddings) read nothing more; the
first forward pass reads each MLP tensor once, and then the logits equal transformers' own (float32 reference), as
do the eagerly loaded model's. Weights stay bf16 with keep_half, and the circuits still compute in float32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from circuits_core.circuits import composition, virtual_weights
from circuits_core.circuits.copying_spectra import ov_copying_scores
from circuits_core.formats import llama
from circuits_core.formats.checkpoint import load_checkpoint

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}  # fmt: skip
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else noise * 1.5 / math.sqrt(p.shape[-1]))
    path = tmp_path_factory.mktemp("lazy") / "llama"
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")  # several shards and an index
    # the reference: the bf16 weights read back in float32 (a fresh model: `.to` above also rounded its rotary
    # frequencies, a buffer `.float()` would not restore)
    return path, transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def stored_bytes(path: Path) -> dict[str, int]:
    """Tensor name -> stored bytes, from every shard's safetensors header."""
    sizes = {}
    for shard in path.glob("*.safetensors"):
        with shard.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        sizes |= {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    return sizes


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the tensors read from the shards, in order."""
    names: list[str] = []
    original = llama._MappedFile.read

    def counted(self: Any, key: str, dtype: torch.dtype, layout: Any) -> torch.Tensor:
        names.append(key)
        return original(self, key, dtype, layout)

    monkeypatch.setattr(llama._MappedFile, "read", counted)
    return names


def test_a_lazy_load_reads_only_what_the_weight_circuits_need(folder: tuple[Path, Any], reads: list[str]) -> None:
    path, hf = folder
    assert len(list(path.glob("*.safetensors"))) > 1
    sizes = stored_bytes(path)
    mlp = {k for k in sizes if any(f"mlp.{n}." in k for n in MLP_NAMES)}
    loaded = load_checkpoint(path, keep_half=True, lazy_mlp=True)
    model = loaded.model
    assert model.dtype == torch.bfloat16 and model.compute_dtype == torch.float32
    assert set(reads) == set(sizes) - mlp and len(reads) == len(set(reads))  # each tensor once, no MLP tensor
    read_bytes = sum(sizes[k] for k in reads)
    assert read_bytes == sum(sizes.values()) - sum(sizes[k] for k in mlp)

    with torch.no_grad():  # the weight circuits read nothing more
        ov_copying_scores(model)
        composition.composition_scores(model)
        vw = virtual_weights.Writer("embed"), virtual_weights.Reader("K", 1, 0)
        virtual_weights.pair_report(model, *vw)
    assert len(reads) == len(sizes) - len(mlp)

    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.run(tokens)[0].float()
        expected = hf(tokens).logits
    assert sorted(reads[len(sizes) - len(mlp) :]) == sorted(mlp)  # the forward read every MLP tensor, once
    eager = load_checkpoint(path, keep_half=True).model
    with torch.no_grad():
        torch.testing.assert_close(logits, eager.run(tokens)[0].float(), rtol=0, atol=0)
    # float32: the lazily read MLPs (ln2 folded in as they are read) against transformers' run of the same weights;
    # log-probs, since processing centres the unembedding (every logit of a position moves by one amount)
    exact = load_checkpoint(path, lazy_mlp=True).model
    with torch.no_grad():
        ours = exact.run(tokens)[0].log_softmax(-1)
    torch.testing.assert_close(ours, expected.log_softmax(-1), rtol=1e-4, atol=1e-4)


def test_deferred_weights_read_as_stored_without_processing(folder: tuple[Path, Any]) -> None:
    """Without fold_ln the deferred weights are read as stored, and still equal the eager model's."""
    path, _ = folder
    lazy = load_checkpoint(path, process=False, lazy_mlp=True).model
    eager = load_checkpoint(path, process=False).model
    assert lazy.blocks[1].mlp.deferred
    torch.testing.assert_close(lazy.blocks[1].mlp.W_in, eager.blocks[1].mlp.W_in, rtol=0, atol=0)
    assert not lazy.blocks[1].mlp.deferred and lazy.blocks[2].mlp.deferred


def test_a_checkpoint_of_only_the_attention_tensors_serves_the_weight_circuits(
    folder: tuple[Path, Any], tmp_path: Path
) -> None:
    """The same shards with every MLP tensor left out (what a 70B model's attention circuits need): a lazy load
    opens it and its weight circuits equal the full checkpoint's; the forward pass, which needs an MLP, says which
    tensor is missing, and an eager load refuses the folder at once."""
    from safetensors.torch import load_file, save_file

    from circuits_core.errors import CheckpointError

    path, _ = folder
    index = json.loads((path / "model.safetensors.index.json").read_text())
    kept = {k: v for k, v in index["weight_map"].items() if not any(f"mlp.{n}." in k for n in MLP_NAMES)}
    assert len(kept) < len(index["weight_map"])
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {k: t for k, t in load_file(path / shard).items() if k in kept}
        if tensors:
            save_file(tensors, str(tmp_path / shard), metadata={"format": "pt"})
    kept = {k: v for k, v in kept.items() if (tmp_path / v).is_file()}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": kept}))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())

    attention_only = load_checkpoint(tmp_path, dtype=torch.float64, lazy_mlp=True).model
    full = load_checkpoint(path, dtype=torch.float64, lazy_mlp=True).model
    with torch.no_grad():
        torch.testing.assert_close(ov_copying_scores(attention_only), ov_copying_scores(full), rtol=0, atol=0)
        torch.testing.assert_close(
            composition.composition_scores(attention_only).raw["k"], composition.composition_scores(full).raw["k"],
            rtol=0, atol=0,
        )  # fmt: skip
        with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.0\.mlp\.gate_proj\.weight"):
            attention_only.run(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_checkpoint(tmp_path, dtype=torch.float64)
