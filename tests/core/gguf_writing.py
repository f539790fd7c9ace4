"""Writing GGUF files the way llama.cpp's converter does, for the GGUF tests: the hyperparameters every
transformers config with (grouped-query) attention gets, and the three writes that close a file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf


def converter_writer(path: Path, arch: str, cfg: Any, n_kv: int | None = None) -> gguf.GGUFWriter:
    """A writer for `arch` holding the counts and sizes the converter writes for any such config: layers, context,
    widths of the residual stream and the MLP, query and key/value heads (`n_kv` where the converter writes another
    count than the config's: 1 for DeepSeek's latent attention, run by llama.cpp as one shared key/value head)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads if n_kv is None else n_kv)
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    """Write the header, the metadata and the tensors added, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
