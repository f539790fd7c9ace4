"""Hostile battery, part 1: model folders that cannot be read.

Each case is a folder in the models directory of one app (built with create_app over temp folders) beside a
good model. Every one must be listed among the unavailable models with a reason naming the field or file at
fault (and no server path); its own routes answer 422; and nothing else changes: the model list, /readyz,
/, the good model's pages and /tour keep answering 200. No answer is a 5xx.

Cases (`{"model_type": []}`, JSON nested 5,000 deep, `bos_token_id: "x"`, `format_version:
"x"`, GPT-2 `n_head: 0`, NeoX `rope_scaling: "linear"`, a deeply nested qkov.json, `n_layers: 100000`,
shard entries with `../` or absolute paths, symlinked files leaving the folder) and more of the same kinds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from app.main import create_app
from app.settings import Settings
from circuits_core.model.config import ModelConfig
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer

DEEP = "[" * 5000 + "]" * 5000  # the config.json: json.loads raises RecursionError
NESTED_200 = json.dumps(json.loads("{" + '"a": {' * 199 + "}" * 200))  # parses, but 200 levels deep


def good_cfg(d_vocab: int) -> ModelConfig:
    return ModelConfig(
        n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=d_vocab, n_ctx=32, positional_embedding_type="standard"
    )


def qkov_config(folder: Path, **changes: object) -> None:
    """Rewrite a qkov folder's config.json with some fields changed (None: removed)."""
    data = json.loads((folder / "config.json").read_text())
    data.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


GPT2 = {"model_type": "gpt2", "n_embd": 16, "n_head": 2, "n_layer": 1, "vocab_size": 50, "n_positions": 32}
NEOX = {
    "model_type": "gpt_neox",
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 50,
    "max_position_embeddings": 32,
    "intermediate_size": 64,
}


def hf_folder(folder: Path, config: dict[str, object]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"wte.weight": torch.zeros(50, 16)}, str(folder / "model.safetensors"))


def sharded(folder: Path, entries: dict[str, str]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(GPT2))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": entries}))


Builder = Callable[[Path, Path, Path], None]  # (folder, a good qkov folder to copy, outside dir)


def copy_then(edit: Callable[[Path], None]) -> Builder:
    def build(folder: Path, good: Path, outside: Path) -> None:
        shutil.copytree(good, folder)
        edit(folder)

    return build


def write(name: str, text: str | bytes) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)

    return edit


def fields(**changes: object) -> Builder:
    return copy_then(lambda f: qkov_config(f, **changes))


def hf(config: dict[str, object]) -> Builder:
    return lambda folder, good, outside: hf_folder(folder, config)


def link_out(name: str) -> Builder:
    """A copy of the good folder whose `name` is a symlink to a file (or folder) outside the models dir."""

    def build(folder: Path, good: Path, outside: Path) -> None:
        shutil.copytree(good, folder)
        target = outside / f"{folder.name}-{name}"
        if (folder / name).exists():
            shutil.move(str(folder / name), target)
        else:
            target.mkdir()
        (folder / name).symlink_to(target)

    return build


def pickle_bomb(folder: Path, good: Path, outside: Path) -> None:
    """TransformerLens-format folder whose .pth would build an object when unpickled."""
    folder.mkdir(parents=True)
    cfg = json.loads((good / "config.json").read_text())
    cfg.pop("format")
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save({"embed.W_E": Path("/tmp")}, folder / "model.pth")


def two_weight_files(folder: Path, good: Path, outside: Path) -> None:
    pickle_bomb(folder, good, outside)
    (folder / "model.pth").unlink()
    save_file({"a": torch.zeros(1)}, str(folder / "a.safetensors"))
    save_file({"b": torch.zeros(1)}, str(folder / "b.safetensors"))


def tensor_edit(change: Callable[[dict[str, torch.Tensor]], None]) -> Builder:
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))
        change(state)
        save_file(state, str(folder / "model.safetensors"))

    return copy_then(edit)


def _set(state: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    state[key] = value


def loop_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(folder / "tokenizer.json")


def bigger_tokenizer() -> str:
    """The models' tokenizer with 50 more tokens than their d_vocab."""
    tok = train_tokenizer()
    tok.add_tokens([f"<extra-{i}>" for i in range(50)])
    return str(tok.to_str())


# id -> (builder, a phrase the reason must contain)
CASES: dict[str, tuple[Builder, str]] = {
    # config.json that is not a readable object
    "model-type-list": (copy_then(write("config.json", '{"model_type": []}')), "model_type"),
    "model-type-object": (copy_then(write("config.json", '{"model_type": {"a": 1}}')), "model_type"),
    "model-type-unknown": (copy_then(write("config.json", '{"model_type": "mamba"}')), "mamba"),
    "config-deep-5000": (copy_then(write("config.json", DEEP)), "config.json"),
    "config-deep-object": (copy_then(write("config.json", NESTED_200)), "nested"),
    "config-array": (copy_then(write("config.json", "[1, 2]")), "JSON object"),
    "config-truncated": (copy_then(write("config.json", '{"n_layers": ')), "not readable JSON"),
    "config-empty": (copy_then(write("config.json", "")), "not readable JSON"),
    "config-binary": (copy_then(write("config.json", b"\xff\xfe\x00garbage")), "not readable JSON"),
    "config-no-format": (copy_then(write("config.json", '{"hello": 1}')), "not a known checkpoint format"),
    "config-5000-digit-int": (copy_then(write("config.json", '{"n_layers": ' + "9" * 5000 + "}")), "config.json"),
    # wrong-typed or absurd fields of a qkov / TransformerLens config
    "bos-string": (fields(bos_token_id="x"), "bos_token_id"),
    "bos-negative": (fields(bos_token_id=-3), "bos_token_id"),
    "format-version-string": (fields(format_version="x"), "format_version"),
    "format-version-future": (fields(format_version=99), "format_version"),
    "n-layers-100000": (fields(n_layers=100000), "n_layers"),
    "n-layers-negative": (fields(n_layers=-1), "n_layers"),
    "n-layers-float": (fields(n_layers=1.5), "n_layers"),
    "n-layers-bool": (fields(n_layers=True), "n_layers"),
    "d-model-string": (fields(d_model="16"), "d_model"),
    "n-heads-zero": (fields(n_heads=0), "n_heads"),
    "n-ctx-null": (fields(n_ctx=None), "n_ctx"),
    "d-vocab-list": (fields(d_vocab=[[[[1]]]]), "d_vocab"),
    "d-vocab-huge": (fields(d_vocab=10**12), "over the limit"),
    "d-model-huge": (fields(d_model=10**6, d_head=500000), "over the limit"),
    "eps-string": (fields(eps="small"), "eps"),
    "eps-negative": (fields(eps=-1.0), "eps"),
    "normalization-unknown": (fields(normalization_type="BatchNorm"), "normalization_type"),
    "positional-int": (fields(positional_embedding_type=7), "positional_embedding_type"),
    "act-fn-unknown": (fields(attn_only=False, d_mlp=8, act_fn="swish"), "act_fn"),
    "attn-only-string": (fields(attn_only="yes"), "attn_only"),
    "rotary-dim-odd": (fields(positional_embedding_type="rotary", rotary_dim=3), "rotary_dim"),
    "use-bias-int": (fields(use_bias=1), "use_bias"),
    "attn-scale-string": (fields(attn_scale="big"), "attn_scale"),
    # Hugging Face configs
    "gpt2-n-head-zero": (hf({**GPT2, "n_head": 0}), "n_head"),
    "gpt2-n-head-string": (hf({**GPT2, "n_head": "x"}), "n_head"),
    "gpt2-not-divisible": (hf({**GPT2, "n_head": 3}), "divisible"),
    "gpt2-missing-n-layer": (hf({k: v for k, v in GPT2.items() if k != "n_layer"}), "n_layer"),
    "gpt2-activation": (hf({**GPT2, "activation_function": "swish"}), "activation"),
    "gpt2-bos-string": (hf({**GPT2, "bos_token_id": "x"}), "bos_token_id"),
    "gpt2-eps-list": (hf({**GPT2, "layer_norm_epsilon": [1]}), "layer_norm_epsilon"),
    "gpt2-n-layer-100000": (hf({**GPT2, "n_layer": 100000}), "n_layers"),
    "gpt2-huge-dims": (hf({**GPT2, "n_embd": 2**20, "n_head": 1, "vocab_size": 2**20}), "wte.weight"),
    "neox-rope-linear": (hf({**NEOX, "rope_scaling": "linear"}), "rope_scaling"),
    "neox-rope-type": (hf({**NEOX, "rope_scaling": {"type": "linear", "factor": 2.0}}), "rope_type"),
    "neox-rotary-pct": (hf({**NEOX, "rotary_pct": 5}), "rotary_pct"),
    "neox-hidden-list": (hf({**NEOX, "hidden_size": [16]}), "hidden_size"),
    "tl-unsupported": (fields(format=None, gated_mlp=True, use_bias=None), "gated_mlp"),
    # qkov.json (processing choice)
    "qkov-json-deep-5000": (copy_then(write("qkov.json", DEEP)), "qkov.json"),
    "qkov-json-deep-object": (copy_then(write("qkov.json", NESTED_200)), "qkov.json"),
    "qkov-json-processing-string": (copy_then(write("qkov.json", '{"processing": "yes"}')), "processing"),
    "qkov-json-unknown-switch": (copy_then(write("qkov.json", '{"processing": {"fold_all": true}}')), "fold_all"),
    # files named by the checkpoint, and files leaving the folder
    "shard-dotdot": (lambda f, g, o: sharded(f, {"wte.weight": "../outside.safetensors"}), "inside its folder"),
    "shard-absolute": (lambda f, g, o: sharded(f, {"wte.weight": "/etc/passwd"}), "inside its folder"),
    "shard-nested-dotdot": (lambda f, g, o: sharded(f, {"wte.weight": "sub/../../x.safetensors"}), "inside its folder"),
    "shard-not-a-map": (lambda f, g, o: sharded(f, ["a"]), "shard index"),  # type: ignore[arg-type]
    "symlink-weights": (link_out("model.safetensors"), "symlink"),
    "symlink-tokenizer": (link_out("tokenizer.json"), "symlink"),
    "symlink-subfolder": (link_out("extra"), "symlink"),
    "symlink-loop": (copy_then(lambda f: (f / "loop.json").symlink_to(f / "loop.json")), "symlink loop"),
    "symlink-loop-tokenizer": (copy_then(loop_tokenizer), "symlink loop"),
    # weights and side files that do not fit
    "weights-missing": (copy_then(lambda f: (f / "model.safetensors").unlink()), "model.safetensors"),
    "weights-truncated": (copy_then(write("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{")), "safetensors"),
    "weights-wrong-shape": (tensor_edit(lambda s: _set(s, "embed.W_E", torch.zeros(3, 3))), "shape"),
    "weights-integer": (
        tensor_edit(lambda s: _set(s, "embed.W_E", torch.zeros_like(s["embed.W_E"]).long())),
        "floating-point",
    ),
    "weights-missing-key": (tensor_edit(lambda s: s.__delitem__("blocks.0.attn.W_Q")), "W_Q"),
    "pickle-object": (pickle_bomb, "unpickle"),
    "two-weight-files": (two_weight_files, "several weight files"),
    "tokenizer-garbage": (copy_then(write("tokenizer.json", "{not json")), "tokenizer"),
    "tokenizer-too-big": (copy_then(lambda f: write("tokenizer.json", bigger_tokenizer())(f)), "tokenizer has"),
    "tokenizer-config-deep": (copy_then(write("tokenizer_config.json", DEEP)), "tokenizer_config.json"),
    "card-deep": (copy_then(write("model_card.json", NESTED_200)), "model_card.json"),
    "card-array": (copy_then(write("model_card.json", "[]")), "model_card.json"),
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, model_dirs: tuple[Path, Path]) -> tuple[Path, Path, Path]:
    base = tmp_path_factory.mktemp("hostile")
    shipped, models, outside = base / "shipped", base / "models", base / "outside"
    outside.mkdir()
    (outside / "outside.safetensors").write_bytes(b"")
    shutil.copytree(model_dirs[0] / "tiny-2l", shipped / "tiny-2l")
    tok = train_tokenizer()
    good = base / "template"
    save_qkov(good, good_cfg(tok.get_vocab_size()), tok, seed=5)
    shutil.copytree(good, models / "good")
    for name, (build, _) in CASES.items():
        build(models / name, good, outside)
    return shipped, models, base


@pytest.fixture(scope="module")
def app_client(hostile: tuple[Path, Path, Path]) -> Iterator[TestClient]:
    shipped, models, _ = hostile
    settings = Settings(shipped_dir=shipped, models_dir=models, dtype="float32", limits=LIMITS)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def test_the_battery_has_at_least_60_folders() -> None:
    assert len(CASES) >= 60


def test_every_hostile_folder_is_listed_unavailable_and_the_rest_still_answers(
    app_client: TestClient, hostile: tuple[Path, Path, Path]
) -> None:
    listed = app_client.get("/api/v1/models")
    assert listed.status_code == 200, listed.text
    assert {m["id"] for m in listed.json()} == {"tiny-2l", "good"}
    unavailable = app_client.get("/api/v1/unavailable-models")
    assert unavailable.status_code == 200, unavailable.text
    reasons = {u["id"]: u["detail"] for u in unavailable.json()}
    assert set(reasons) == set(CASES)
    for name, (_, needle) in CASES.items():
        assert needle.lower() in reasons[name].lower(), (name, reasons[name])
        assert str(hostile[2]) not in reasons[name] and "/tmp" not in reasons[name], (name, reasons[name])
    for path in ("/readyz", "/", "/tour", "/models/good", "/models/tiny-2l", "/api/v1/models/good/heads", "/healthz"):
        answer = app_client.get(path)
        assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
    assert app_client.get("/readyz").json()["status"] == "ready"


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_hostile_folder_answers_422_naming_the_fault(
    app_client: TestClient, hostile: tuple[Path, Path, Path], name: str
) -> None:
    needle = CASES[name][1]
    body = assert_problem(app_client.get(f"/api/v1/models/{name}"), 422, needle)
    assert str(hostile[2]) not in body["detail"] and "/tmp/" not in body["detail"]
    assert_problem(app_client.get(f"/api/v1/models/{name}/heads"), 422)
    page = app_client.get(f"/models/{name}")
    assert page.status_code == 422 and page.headers["content-type"].startswith("text/html")
    assert str(hostile[2]) not in page.text


def test_nothing_outside_the_folder_was_read(hostile: tuple[Path, Path, Path]) -> None:
    """The symlink targets and the shard outside still exist untouched (and were never loaded: 422 above)."""
    outside = hostile[2] / "outside"
    assert (outside / "outside.safetensors").read_bytes() == b""
    assert (outside / "symlink-weights-model.safetensors").is_file()
