"""Training corpus and tokenizer of the shipped toy models: the Python standard library's own sources.

Paper context: Elhage et al. 2021 study small attention-only models trained on text; qkov trains its
own on code, which every machine with Python has and where identifiers repeat densely within a context
window (the data on which induction heads pay off).

Corpus: every `*.py` under `sysconfig.get_paths()["stdlib"]`, walked in sorted order, skipping the
directories in EXCLUDED_DIRS. A file is held out for validation when `sha1(relpath) % 20 == 0`. Files are
joined with `<|endoftext|>` (EOT), which is also the BOS token of every training window.

Another interpreter has another standard library, so the corpus is pinned by a manifest (relative path
and sha256 of every file) written next to the checkpoints.

Tokenizer: byte-level BPE (Hugging Face `tokenizers`), vocabulary 4096, EOT is token 0.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"})
VAL_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """Relative paths (posix) of the corpus's `.py` files under `root`, in sorted-walk order."""
    root = stdlib_root() if root is None else root
    found: list[str] = []

    def walk(folder: Path) -> None:
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            if entry.is_dir() and not entry.is_symlink():
                if entry.name not in EXCLUDED_DIRS:
                    walk(entry)
            elif entry.is_file() and entry.suffix == ".py":
                found.append(entry.relative_to(root).as_posix())

    walk(root)
    return found


def is_val(relpath: str) -> bool:
    """Held-out split by file: sha1(relpath) % 20 == 0."""
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % VAL_MODULUS == 0


def train_tokenizer(texts: list[str], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE with EOT as the only special token (id 0)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_files(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """EOT + file + EOT + file ... as one uint16 stream."""
    eot = tok.token_to_id(EOT)
    parts: list[np.ndarray] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.array([eot], dtype=np.uint16))
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


@dataclass
class Corpus:
    """Tokenized train/val streams, the tokenizer and the manifest of the files used."""

    train: np.ndarray  # [n_train_tokens] uint16
    val: np.ndarray  # [n_val_tokens] uint16
    tokenizer: Tokenizer
    manifest: list[dict[str, str | int | bool]] = field(default_factory=list)
    source: str = ""

    @property
    def eot(self) -> int:
        eot = self.tokenizer.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"the corpus tokenizer has no {EOT!r} token")
        return eot

    def stats(self) -> dict[str, object]:
        train = [m for m in self.manifest if not m["val"]]
        val = [m for m in self.manifest if m["val"]]
        return {
            "source": self.source,
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "split": f"sha1(relpath) % {VAL_MODULUS} == 0 -> val",
            "train_files": len(train),
            "val_files": len(val),
            "train_bytes": int(sum(int(m["bytes"]) for m in train)),
            "val_bytes": int(sum(int(m["bytes"]) for m in val)),
            "train_tokens": int(len(self.train)),
            "val_tokens": int(len(self.val)),
            "vocab_size": int(self.tokenizer.get_vocab_size()),
            "manifest_sha256": manifest_digest(self.manifest),
        }

    def train_counts(self) -> np.ndarray:
        """[d_vocab] int64: how often each token occurs in the training stream."""
        return np.bincount(self.train.astype(np.int64), minlength=self.tokenizer.get_vocab_size())


def manifest_digest(manifest: list[dict[str, str | int | bool]]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def build_corpus(root: Path | None = None, vocab_size: int = 4096) -> Corpus:
    """Read the stdlib, train the tokenizer on the training files, tokenize both splits."""
    root = stdlib_root() if root is None else root
    manifest: list[dict[str, str | int | bool]] = []
    train_texts: list[str] = []
    val_texts: list[str] = []
    for rel in corpus_files(root):
        data = (root / rel).read_bytes()
        manifest.append(
            {"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "val": is_val(rel)}
        )
        text = data.decode("utf-8", errors="replace")
        (val_texts if is_val(rel) else train_texts).append(text)
    tok = train_tokenizer(train_texts, vocab_size)
    return Corpus(
        encode_files(tok, train_texts), encode_files(tok, val_texts), tok, manifest, source=source_label(root)
    )


def source_label(root: Path) -> str:
    """What the corpus is, without the training machine's paths: 'CPython 3.11.7 standard library (python3.11)'."""
    return (
        f"CPython {platform.python_version()} standard library ({Path(root).name})"
        if Path(root) == stdlib_root()
        else f"Python sources ({Path(root).name})"
    )


def save_corpus(corpus: Corpus, folder: Path) -> None:
    """train.npy, val.npy, tokenizer.json, corpus_manifest.json (a cache; also what travels to a GPU)."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "train.npy", corpus.train)
    np.save(folder / "val.npy", corpus.val)
    corpus.tokenizer.save(str(folder / "tokenizer.json"))
    write_manifest(corpus, folder / "corpus_manifest.json")


def write_manifest(corpus: Corpus, path: Path) -> None:
    path.write_text(json.dumps({"stats": corpus.stats(), "files": corpus.manifest}, indent=1) + "\n")


def load_corpus(folder: Path) -> Corpus:
    meta = json.loads((folder / "corpus_manifest.json").read_text())
    return Corpus(
        np.load(folder / "train.npy"),
        np.load(folder / "val.npy"),
        Tokenizer.from_file(str(folder / "tokenizer.json")),
        meta["files"],
        source=meta["stats"]["source"],
    )


def load_or_build(folder: Path | None) -> Corpus:
    """The cached corpus in `folder` if there is one, else build it (and cache it there)."""
    if folder is not None and (folder / "corpus_manifest.json").exists():
        return load_corpus(folder)
    corpus = build_corpus()
    if folder is not None:
        save_corpus(corpus, folder)
    return corpus
