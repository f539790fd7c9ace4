"""The digest of a load that defers the MLP weights (formats/read_digest.py): keyed by the bytes it reads and by the
identity of the files holding the tensors it defers, it still changes whenever any weight the model uses could.

The checkpoint: a transformers Llama's weights in two shards with an index, one holding the attention, norms and
embeddings (nothing deferred: only the hashes of the bytes read can tell a change there), the other the MLPs (only
its file identity is in the key). Each change is made in place with the file's size and mtime put back, so only what
the digest claims to see (the bytes read, the ctime) can tell.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from circuits_core.errors import CheckpointError
from circuits_core.formats import read_digest
from circuits_core.formats.checkpoint import load_checkpoint

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}  # fmt: skip
ATTENTION, MLP = "attention.safetensors", "mlp.safetensors"


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) / 4)
    path = tmp_path_factory.mktemp("digest") / "llama"
    model.to(torch.bfloat16).save_pretrained(path)
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    shards = {MLP: {k: v for k, v in state.items() if ".mlp." in k}}
    shards[ATTENTION] = {k: v for k, v in state.items() if k not in shards[MLP]}
    for name, tensors in shards.items():
        save_file(tensors, str(path / name), metadata={"format": "pt"})
    weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture
def folder(original: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh copy; its files' ctimes are now, within read_digest's racy window, which is closed here (RACY_S 0) so
    the deferred shard is keyed by its identity, as any file not written in the last seconds is."""
    copy = tmp_path / "llama"
    shutil.copytree(original, copy)
    monkeypatch.setattr(read_digest, "RACY_S", 0.0)
    return copy


def lazy_digest(path: Path) -> str:
    return load_checkpoint(path, keep_half=True, lazy_mlp=True).digest


def change_in_place(path: Path, tensor: str) -> None:
    """Add 1 to one stored bf16 element of `tensor`, writing those two bytes in place, then put back the file's
    mtime (so its size and mtime are as before; its ctime is now)."""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        start = 8 + n + json.loads(f.read(n))[tensor]["data_offsets"][0]
    st = os.stat(path)
    with path.open("r+b") as f:
        f.seek(start)
        value = torch.frombuffer(bytearray(f.read(2)), dtype=torch.bfloat16)
        f.seek(start)
        f.write((value + 1).view(torch.uint8).numpy().tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_the_same_files_give_the_same_key_and_a_lazy_load_reads_no_mlp_byte(folder: Path) -> None:
    first = load_checkpoint(folder, keep_half=True, lazy_mlp=True)
    assert first.provenance()["mlp_weights"] == "deferred in 2 of 2 layers"
    assert lazy_digest(folder) == first.digest and len(first.digest) == 64


def test_a_changed_weight_that_the_load_reads_changes_the_key(folder: Path) -> None:
    """The attention shard holds nothing deferred, so its identity is not in the key: only its bytes, hashed as read."""
    before = lazy_digest(folder)
    change_in_place(folder / ATTENTION, "model.layers.1.self_attn.q_proj.weight")
    assert lazy_digest(folder) != before


def test_a_changed_deferred_weight_changes_the_key(folder: Path) -> None:
    """Same size, same mtime, same inode: the ctime the write set is what tells."""
    before = lazy_digest(folder)
    change_in_place(folder / MLP, "model.layers.0.mlp.down_proj.weight")
    assert lazy_digest(folder) != before


def test_a_changed_config_changes_the_key(folder: Path) -> None:
    before = lazy_digest(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    assert lazy_digest(folder) != before


def test_deferred_weights_are_read_only_from_the_files_the_key_names(folder: Path) -> None:
    """A shard changed after the load: the first use of an MLP weight refuses instead of reading other weights."""
    loaded = load_checkpoint(folder, keep_half=True, lazy_mlp=True)
    change_in_place(folder / MLP, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match="changed after the model was loaded"):
        loaded.model(torch.tensor([[1, 2, 3]]))


def test_a_racy_shard_is_keyed_by_its_bytes(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the racy window two copies (other inodes) have other keys (identity: a cache miss only). Within it a
    shard holding deferred tensors is hashed whole: the copies have one key, and a changed MLP byte changes it."""
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    assert lazy_digest(other) != lazy_digest(folder)
    monkeypatch.setattr(read_digest, "RACY_S", math.inf)
    assert lazy_digest(other) == lazy_digest(folder)
    change_in_place(other / MLP, "model.layers.0.mlp.gate_proj.weight")
    assert lazy_digest(other) != lazy_digest(folder)
