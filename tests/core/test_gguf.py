"""GGUF checkpoints (circuits_core/formats/gguf.py) against transformers' own GGUF reader, on tiny files written
here with the gguf library's GGUFWriter the way llama.cpp's converter writes them (Q/K rows permuted to the
adjacent-pairs rotary layout, tied embeddings left out, F32 norms, quantised matrices).

transformers dequantises GGUF tensors with its own code and undoes the Q/K permutation (rotate-half), so equal
logits check the dequantisation, the tensor mapping and the rotary layout along an independent path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from circuits_core.errors import CheckpointError
from circuits_core.formats import gguf_quants
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.detect import detect_format
from circuits_core.formats.gguf import read_gguf
from circuits_core.formats.gguf_header import GGUFHeader
from circuits_core.formats.gguf_tokenizer import LLAMA3_SPLIT, byte_level_pre_tokenizer
from circuits_core.formats.statedict import build_model, load_bytes
from circuits_core.prompt.model_summary import SUMMARY_FILE, ensure_summary, load_summary, measure
from tests.bpe import EOT, train_bpe

Q = gguf.GGMLQuantizationType
N_LAYERS, D_MODEL, N_HEADS, N_KV, D_HEAD, D_MLP, N_CTX = 2, 64, 4, 2, 16, 96, 64
TEXTS = ["the cat sat on the mat", "a dog ran in the park and the cat sat", "hello world, the end"] * 20


def _bpe(texts: list[str] = TEXTS) -> tuple[list[str], list[str], int]:
    """(tokens in id order, merges 'a b', id of EOT) of a tiny byte-level BPE trained on `texts`."""
    data = json.loads(train_bpe(texts, 300).to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges, vocab[EOT]


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: Hugging Face's rotate-half rows (head, half, i) -> adjacent pairs (head, i, half)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    matrix_type: Q = Q.Q8_0,
    tied: bool = True,
    tokenizer_model: str = "gpt2",
    pre: str = "gpt-2",
    extra_kv: dict[str, str] | None = None,
    seed: int = 0,
    bos_token_id: int | None = None,
    extra_arrays: dict[str, list] | None = None,
    extra_tokens: int = 0,
    n_merges: int | None = None,
    texts: list[str] = TEXTS,
) -> dict[str, np.ndarray]:
    """A tiny Llama-family GGUF; returns the float32 tensors written (HF layout, before permutation/quantisation).
    `extra_arrays`: metadata arrays qkov never reads; `extra_tokens`: vocabulary entries beyond the embedding's rows;
    `n_merges`: the merges list padded to this many (repeating its first merge); `texts`: what the BPE is trained on."""
    rng = np.random.default_rng(seed)
    tokens, merges, eot = _bpe(texts)
    d_vocab = len(tokens)
    tokens = tokens + [f"<extra{i}>" for i in range(extra_tokens)]
    if n_merges is not None:
        merges = merges + merges[:1] * (n_merges - len(merges))

    def rand(*shape: int, std: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    hf: dict[str, np.ndarray] = {
        "token_embd.weight": rand(d_vocab, D_MODEL, std=1.0),
        "output_norm.weight": 1 + rand(D_MODEL),
    }
    if not tied:
        hf["output.weight"] = rand(d_vocab, D_MODEL)
    for layer in range(N_LAYERS):
        b = f"blk.{layer}"
        if arch == "qwen2":  # Qwen2 has q/k/v biases
            hf |= {f"{b}.attn_q.bias": rand(N_HEADS * D_HEAD), f"{b}.attn_k.bias": rand(N_KV * D_HEAD),
                   f"{b}.attn_v.bias": rand(N_KV * D_HEAD)}  # fmt: skip
        hf |= {
            f"{b}.attn_norm.weight": 1 + rand(D_MODEL), f"{b}.ffn_norm.weight": 1 + rand(D_MODEL),
            f"{b}.attn_q.weight": rand(N_HEADS * D_HEAD, D_MODEL), f"{b}.attn_k.weight": rand(N_KV * D_HEAD, D_MODEL),
            f"{b}.attn_v.weight": rand(N_KV * D_HEAD, D_MODEL), f"{b}.attn_output.weight": rand(D_MODEL, N_HEADS * D_HEAD),  # noqa: E501 (a table kept on one line)
            f"{b}.ffn_gate.weight": rand(D_MLP, D_MODEL), f"{b}.ffn_up.weight": rand(D_MLP, D_MODEL),
            f"{b}.ffn_down.weight": rand(D_MODEL, D_MLP),
        }  # fmt: skip
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(D_MODEL)
    writer.add_feed_forward_length(D_MLP)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(D_HEAD)
    writer.add_vocab_size(d_vocab)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t == EOT else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eot if bos_token_id is None else bos_token_id)
    writer.add_eos_token_id(eot)
    for key, value in (extra_kv or {}).items():
        writer.add_string(key, value)
    for key, items in (extra_arrays or {}).items():
        writer.add_array(key, items)
    for name, value in hf.items():
        if name.endswith(("attn_q.weight", "attn_k.weight")) and arch != "qwen2":  # Qwen2's rows stay rotate-half
            value = llama_permute(value, N_HEADS if "attn_q" in name else N_KV)
        if value.ndim == 1:
            writer.add_tensor(name, value)  # F32
        else:
            qtype = Q.Q8_0 if name == "token_embd.weight" else matrix_type
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture(
    scope="module",
    params=[(Q.Q8_0, True, "llama"), (Q.Q4_1, False, "llama"), (Q.F32, True, "llama"), (Q.Q8_0, False, "qwen2")],
    ids=["q8_0-tied", "q4_1-untied", "f32", "qwen2-biases"],
)
def tiny(request, tmp_path_factory):
    matrix_type, tied, arch = request.param
    folder = tmp_path_factory.mktemp("gguf") / f"tiny-{arch}"
    folder.mkdir()
    written = write_gguf(folder / "tiny.gguf", arch=arch, matrix_type=matrix_type, tied=tied)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    return folder, written, hf, matrix_type


def _tokens(d_vocab: int) -> torch.Tensor:
    return torch.randint(0, d_vocab, (2, 40), generator=torch.Generator().manual_seed(1))


def test_logits_equal_transformers_reading_the_same_file(tiny):
    folder, _, hf, _ = tiny
    loaded = load_checkpoint(folder, process=False)
    assert loaded.format == "gguf" and detect_format(folder) == "gguf"
    cfg = loaded.model.cfg
    assert (cfg.n_heads, cfg.n_key_value_heads) == (N_HEADS, N_KV)
    assert cfg.rotary_adjacent_pairs == (folder.name == "tiny-llama") and cfg.use_bias == (folder.name == "tiny-qwen2")
    tokens = _tokens(cfg.d_vocab)
    with torch.no_grad():
        expected = hf(tokens).logits
    got = loaded.model.run(tokens)[0]
    # float32 on both sides (transformers computes its rotary angles in float32 even for a float64 model).
    assert (got - expected).abs().max() < 1e-4
    # Processed weights (RMS gains folded, W_U centred): the same next-token distributions, in float64.
    raw64 = load_checkpoint(folder, dtype=torch.float64, process=False).model.run(tokens)[0]
    processed64 = load_checkpoint(folder, dtype=torch.float64).model.run(tokens)[0]
    assert (processed64.log_softmax(-1) - raw64.log_softmax(-1)).abs().max() < 1e-9


def test_the_rotate_half_layout_on_a_gguf_gives_other_logits(tiny):
    """The trap the layout switch guards against: the same weights read as rotate-half still run, wrongly."""
    folder, _, hf, _ = tiny
    read = read_gguf(folder / "tiny.gguf")
    cfg, state, origin = read.cfg, read.state, read.origin
    wrong_layout = dataclasses.replace(cfg, rotary_adjacent_pairs=not cfg.rotary_adjacent_pairs)
    wrong = build_model(wrong_layout, state, torch.float32, origin)
    tokens = _tokens(cfg.d_vocab)
    with torch.no_grad():
        expected = hf(tokens).logits
    assert (wrong.run(tokens)[0] - expected).abs().max() > 1e-2


def test_tensors_round_trip(tiny):
    """Each tensor read back equals what was written: F32 exactly; a quantised one within its format's rounding
    (Q8_0: half a step of max|block|/127; Q4_1: half a step of (max - min)/15 per block of 32; plus the float16
    rounding of the block's scale) and bit-equal to transformers' own dequantisation."""
    folder, written, hf, matrix_type = tiny
    state = read_gguf(folder / "tiny.gguf").state
    hf_state = hf.state_dict()
    assert torch.equal(state["blocks.1.ln1.w"], torch.from_numpy(written["blk.1.attn_norm.weight"]))
    assert torch.equal(state["ln_final.w"], torch.from_numpy(written["output_norm.weight"]))
    original = torch.from_numpy(written["blk.0.ffn_gate.weight"])  # [d_mlp, d_model]
    got = state["blocks.0.mlp.W_gate"].T
    blocks = original.reshape(D_MLP, D_MODEL // 32, 32)
    if matrix_type == Q.F32:
        step = torch.zeros_like(blocks)
    elif matrix_type == Q.Q8_0:
        step = blocks.abs().amax(-1, keepdim=True).expand_as(blocks) / 127
    else:
        step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)).expand_as(blocks) / 15
    err = (got - original).reshape_as(blocks).abs()
    fp16_scales = blocks.abs().amax(-1, keepdim=True) * 2.0**-9  # the block's scale (and offset) are float16
    assert (err <= step / 2 + fp16_scales).all()
    if matrix_type != Q.F32:
        assert err.max() > 0  # really quantised
    assert torch.equal(got, hf_state["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(state["blocks.1.mlp.W_out"].T, hf_state["model.layers.1.mlp.down_proj.weight"])
    # Q rows: a llama file holds them permuted; undoing llama.cpp's permutation gives transformers' q_proj.
    W_Q = state["blocks.0.attn.W_Q"]  # [n_heads, d_model, d_head], the file's order
    rows = W_Q.transpose(1, 2).reshape(-1, D_MODEL)
    if folder.name == "tiny-llama":
        rows = rows.reshape(N_HEADS, D_HEAD // 2, 2, D_MODEL).transpose(1, 2).reshape(-1, D_MODEL)
    assert torch.equal(rows, hf_state["model.layers.0.self_attn.q_proj.weight"])
    if folder.name == "tiny-qwen2":
        assert torch.equal(state["blocks.1.attn._b_K"].flatten(), hf_state["model.layers.1.self_attn.k_proj.bias"])
        assert torch.equal(state["blocks.1.attn.b_Q"].flatten(), torch.from_numpy(written["blk.1.attn_q.bias"]))


def test_tokenizer_from_the_metadata_matches_the_trained_one_and_transformers(tiny):
    folder, _, _, _ = tiny
    tok = load_checkpoint(folder).tokenizer
    assert tok is not None
    source = train_bpe(TEXTS, 300)
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file="tiny.gguf")
    for text in ["the cat sat on the mat", "hello world, the dog!", f"the end{EOT} a park"]:
        ids = tok.encode(text, prepend_bos=False)
        assert ids == source.encode(text).ids
        assert ids == hf_tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
    assert tok.bos_token_id == source.token_to_id(EOT)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_each_byte_level_pre_tokenizer_splits_the_text_as_transformers_reading_the_same_file(tmp_path, pre):
    """Llama 3 ("llama-bpe") takes digits in runs of up to three, Qwen2 one by one; both keep a letter run with one
    leading non-letter ('$cat') and capitalised contractions whole. transformers builds its tokenizer from the same
    GGUF metadata with its own table of llama.cpp's patterns. ("smollm", every digit apart before GPT-2's pattern,
    is not in that table; SmolLM2's vocabulary has no entry of two digits, so test_smollm2's comparison holds.)"""
    folder = tmp_path / pre
    folder.mkdir()
    samples = ["the cat sat 1234567 times", "HE'LL pay $cat 42.5!", "a\n\n  dog ran\tin the park", "x2024y"]
    write_gguf(folder / "tiny.gguf", pre=pre, texts=TEXTS + samples * 20)  # merges across the patterns' cuts
    tok = load_checkpoint(folder).tokenizer
    assert tok is not None
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file="tiny.gguf")
    gpt2 = train_bpe(TEXTS + samples * 20, 300)  # the same vocabulary and merges under GPT-2's own pattern
    differs = 0
    for text in samples:
        ids = tok.encode(text, prepend_bos=False)
        assert ids == hf_tok(text, add_special_tokens=False).input_ids, text
        assert tok.decode(ids) == text
        differs += ids != gpt2.encode(text).ids
    assert differs >= 2  # the samples tell these patterns from GPT-2's


# DeepSeek-V3's pieces, written out by hand from llama.cpp's three patterns (digits in runs of up to three; CJK and
# kana runs; then the rest): a mark stays with its letter (' cafe\u0301s'), punctuation other than ASCII's and symbols
# part from the letters after them ('«', 'quote'; ' €', 'uro'), one ASCII punctuation mark joins the ASCII letters
# after it ("'LL", '(x'), and CJK parts from Latin letters beside it ('abc', '日本', 'def'). Llama 3's pattern splits
# the third and fourth samples otherwise ('abc日本def'; '«quote', ' cafe', '\u0301s').
DEEPSEEK_V3_PIECES = {
    "the cat sat 1234567 times": ["the", " cat", " sat", " ", "123", "456", "7", " times"],
    "HE'LL pay $cat 42.5!": ["HE", "'LL", " pay", " $", "cat", " ", "42", ".", "5", "!"],
    "abc日本def テキスト": ["abc", "日本", "def", " ", "テキスト"],
    "«quote» cafe\u0301s €uro": ["«", "quote", "»", " cafe\u0301s", " €", "uro"],
    "a\n\n  dog(x)": ["a", "\n\n", " ", " dog", "(x", ")"],
}


def test_deepseek_v3_pre_tokenizer_splits_the_text_into_llama_cpp_s_pieces(tmp_path: Path) -> None:
    """transformers' GGUF reader has no table entry for "deepseek-v3", so the reference is the pieces above (by hand)
    and, for the ids, the file's own vocabulary and merges applied to each piece alone by a plain byte-level BPE."""
    samples = list(DEEPSEEK_V3_PIECES)
    texts = TEXTS + samples * 20
    write_gguf(tmp_path / "tiny.gguf", pre="deepseek-v3", texts=texts)
    tok = load_checkpoint(tmp_path).tokenizer
    assert tok is not None
    data = json.loads(train_bpe(texts, 300).to_str())  # the vocabulary and merges write_gguf wrote
    data["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    per_piece = HFTokenizer.from_str(json.dumps(data))
    llama3 = 0
    for text, pieces in DEEPSEEK_V3_PIECES.items():
        split = tok.hf.pre_tokenizer.pre_tokenize_str(text)
        assert [text[a:b] for _, (a, b) in split] == pieces, text
        ids = tok.encode(text, prepend_bos=False)
        assert ids == [i for piece in pieces for i in per_piece.encode(piece, add_special_tokens=False).ids], text
        assert tok.decode(ids) == text
        llama3 += [text[a:b] for _, (a, b) in byte_level_pre_tokenizer(LLAMA3_SPLIT).pre_tokenize_str(text)] != pieces
    assert llama3 == 2


def _refusal(tmp_path: Path, **kwargs) -> str:
    folder = tmp_path / "m"
    folder.mkdir()
    write_gguf(folder / "m.gguf", **kwargs)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    return str(info.value)


def test_other_architectures_are_refused_by_name(tmp_path):
    message = _refusal(tmp_path, arch="falcon")
    assert "'falcon'" in message and "llama" in message


def test_an_unsupported_tokenizer_is_refused_by_name(tmp_path):
    message = _refusal(tmp_path, tokenizer_model="llama")
    assert "tokenizer.ggml.model 'llama'" in message


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path):
    message = _refusal(tmp_path, pre="made-up-pre")
    assert "'made-up-pre'" in message


def test_a_bos_id_outside_the_vocabulary_is_refused_by_name(tmp_path):
    message = _refusal(tmp_path, bos_token_id=10**6)
    assert "tokenizer.ggml.bos_token_id 1000000 is not a token id" in message


def test_rope_scaling_types_not_implemented_are_refused(tmp_path):
    message = _refusal(tmp_path, extra_kv={"llama.rope.scaling.type": "yarn"})
    assert "'yarn'" in message


def test_a_folder_with_two_gguf_files_is_refused(tmp_path):
    folder = tmp_path / "two"
    folder.mkdir()
    write_gguf(folder / "a.gguf")
    write_gguf(folder / "b.gguf", seed=1)
    with pytest.raises(CheckpointError, match="several .gguf files"):
        detect_format(folder)


def test_a_truncated_file_is_refused(tmp_path):
    folder = tmp_path / "cut"
    folder.mkdir()
    write_gguf(folder / "m.gguf")
    data = (folder / "m.gguf").read_bytes()
    (folder / "m.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        load_checkpoint(folder)


def test_a_model_over_the_byte_limit_is_refused_before_any_tensor_is_dequantised(tmp_path, monkeypatch):
    folder = tmp_path / "big"
    folder.mkdir()
    write_gguf(folder / "m.gguf")
    on_disk = (folder / "m.gguf").stat().st_size
    cfg = load_checkpoint(folder).model.cfg
    assert load_bytes(cfg, torch.float32) > on_disk + 1  # so the price, not the file size, refuses it

    def no_tensor_read(*args):
        raise AssertionError("a tensor was read before the price check")

    monkeypatch.setattr(GGUFHeader, "read_bytes", no_tensor_read)
    with pytest.raises(CheckpointError, match="GGUF metadata describes a model of"):
        load_checkpoint(folder, max_bytes=on_disk + 1)


def test_the_stored_summary_is_the_card_until_the_weights_change(tmp_path):
    folder = tmp_path / "summarised"
    folder.mkdir()
    write_gguf(folder / "m.gguf")
    summary, fresh = ensure_summary(folder)
    assert fresh and (folder / SUMMARY_FILE).is_file()
    assert load_checkpoint(folder).card == summary == load_summary(folder)
    assert ensure_summary(folder) == (summary, False)
    os.utime(folder / "m.gguf", ns=(1, 1))  # same bytes, other time: still current (by its sha256), re-stamped
    assert load_summary(folder) == summary
    restamped, fresh = ensure_summary(folder)
    assert not fresh and restamped["source"]["stat"]["m.gguf"][1] == 1 and load_summary(folder) == restamped
    summary = restamped
    loaded = load_checkpoint(folder, process=False)
    assert summary["loss_first_copy"] == round(measure(loaded)["loss_first_copy"], 4)
    write_gguf(folder / "m.gguf", seed=1)  # other weights, same name
    assert load_summary(folder) is None and load_checkpoint(folder).card == {}
    again, fresh = ensure_summary(folder)
    assert fresh and again["source"] != summary["source"] and load_checkpoint(folder).card == again


def test_a_broken_summary_file_is_ignored_not_fatal(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    write_gguf(folder / "m.gguf")
    for text in ["not json", "[" * 100_000 + "]" * 100_000, '{"summary_version": 1, "source": []}', "[]"]:
        (folder / SUMMARY_FILE).write_text(text)
        assert load_summary(folder) is None
        assert load_checkpoint(folder).card == {}


def test_the_embedding_read_in_small_chunks_by_two_threads_is_the_files(tiny, monkeypatch):
    """W_E and W_U come from one pass over token_embd whose row chunks two threads take in turn (a load runs on one
    torch thread, leaving the other core): with chunks of 3 rows, each thread writes many, and both tensors are still
    bit-equal to transformers' own dequantisation of the file."""
    folder, _, hf, _ = tiny
    monkeypatch.setattr(gguf_quants, "CHUNK_VALUES", 3 * D_MODEL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as within a load (llama.one_thread): side_by_side then runs its helper beside
    try:
        state = read_gguf(folder / "tiny.gguf").state
    finally:
        torch.set_num_threads(threads)
    hf_state = hf.state_dict()
    assert torch.equal(state["embed.W_E"], hf_state["model.embed_tokens.weight"])
    assert torch.equal(state["unembed.W_U"].T, hf_state["lm_head.weight"])
