"""Engine side of hostile checkpoints: typed config fields, files inside the folder, the load price.

- ModelConfig checks every field against its annotation: for each field in turn (M1's Llama fields included,
  found by walking the dataclass), a value of a wrong type is refused with an error naming that field.
- ConfigReader names the field of a raw Hugging Face config.
- folder_file / check_contained refuse names and symlinks leading outside the folder.
- load_bytes equals the bytes of the parameters and buffers of the model actually built (an independent count).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import torch

from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.formats.statedict import check_contained, folder_file, load_bytes, read_json_object
from circuits_core.model.config import MAX_LAYERS, ModelConfig
from circuits_core.model.config_reader import ConfigReader
from circuits_core.model.transformer import Transformer

BASE: dict[str, object] = dict(n_layers=2, d_model=16, n_heads=4, d_head=4, d_vocab=30, n_ctx=12)


def wrong_value(tp: object) -> object:
    """A value no annotation of a config field accepts unless it is Any: a list."""
    return [[1]]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(ModelConfig)])
def test_every_config_field_is_type_checked_by_name(name: str) -> None:
    hint = typing.get_type_hints(ModelConfig)[name]
    with pytest.raises(InvalidInputError, match=rf"\b{name}\b"):
        ModelConfig(**{**BASE, name: wrong_value(hint)})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("n_layers", True),
        ("n_layers", 1.0),
        ("n_layers", MAX_LAYERS + 1),
        ("n_layers", -1),
        ("d_model", "16"),
        ("n_heads", 0),
        ("d_vocab", None),
        ("eps", "1e-5"),
        ("eps", 0.0),
        ("eps", float("nan")),
        ("attn_only", 1),
        ("bos_token_id", "x"),
        ("bos_token_id", -1),
        ("normalization_type", "BatchNorm"),
        ("use_bias", "false"),
        ("attn_scale", -1.0),
        ("rotary_base", float("inf")),
    ],
)
def test_wrong_values_name_the_field(name: str, value: object) -> None:
    with pytest.raises(InvalidInputError, match=rf"\b{name}\b"):
        ModelConfig(**{**BASE, name: value})  # type: ignore[arg-type]


def test_ints_given_to_float_fields_are_stored_as_floats() -> None:
    cfg = ModelConfig(**{**BASE, "eps": 1, "rotary_base": 10000})  # type: ignore[arg-type]
    assert isinstance(cfg.eps, float) and isinstance(cfg.rotary_base, float)
    assert cfg == ModelConfig(**{**BASE, "eps": 1.0, "rotary_base": 10000.0})  # type: ignore[arg-type]


def test_from_dict_refuses_non_objects_and_names_missing_fields() -> None:
    with pytest.raises(InvalidInputError, match="JSON object"):
        ModelConfig.from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="n_ctx"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "n_ctx"})


def test_config_reader_names_the_field() -> None:
    r = ConfigReader(
        {"n_head": 0, "eps": "x", "tie": 1, "act": 3, "rope_scaling": "linear", "ok": 5, "nul": None}, "config.json"
    )
    assert r.integer("ok", ge=1) == 5 and r.integer("missing", default=7) == 7 and r.integer("nul", default=2) == 2
    for call, field in (
        (lambda: r.integer("n_head", ge=1), "n_head"),
        (lambda: r.number("eps"), "eps"),
        (lambda: r.flag("tie"), "tie"),
        (lambda: r.text("act"), "act"),
        (lambda: r.section("rope_scaling"), "rope_scaling"),
        (lambda: r.integer("absent"), "absent"),
    ):
        with pytest.raises(CheckpointError, match=rf"config.json: .*\b{field}\b"):
            call()
    nested = ConfigReader({"rope_scaling": {"factor": "big"}}).section("rope_scaling")
    with pytest.raises(CheckpointError, match=r"rope_scaling\.factor"):
        nested.number("factor")
    with pytest.raises(CheckpointError, match="JSON object"):
        ConfigReader([1])


def test_folder_file_keeps_names_inside(tmp_path: Path) -> None:
    model, outside = tmp_path / "model", tmp_path / "outside"
    model.mkdir()
    outside.mkdir()
    (model / "a.safetensors").write_bytes(b"")
    (model / "sub").mkdir()
    (outside / "secret").write_text("x")
    (model / "inner-link").symlink_to(model / "a.safetensors")
    (model / "outer-link").symlink_to(outside / "secret")
    assert folder_file(model, "a.safetensors") == (model / "a.safetensors").resolve()
    assert folder_file(model, "sub/x.bin") == (model / "sub" / "x.bin").resolve()
    assert folder_file(model, "inner-link") == (model / "a.safetensors").resolve()  # a link that stays inside
    for name in (
        "../outside/secret",
        "/etc/passwd",
        str(outside / "secret"),
        "sub/../../outside/secret",
        "",
        "outer-link",
        "a\x00b",
    ):
        with pytest.raises(CheckpointError) as refused:
            folder_file(model, name)
        assert str(tmp_path) not in str(refused.value)
    with pytest.raises(CheckpointError):
        folder_file(model, 5)  # type: ignore[arg-type]


def test_check_contained_finds_links_out_at_any_depth(tmp_path: Path) -> None:
    model, outside = tmp_path / "model", tmp_path / "outside"
    (model / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    (model / "a" / "inside").symlink_to(model / "a")
    check_contained(model)  # links that stay inside are fine
    (model / "a" / "b" / "deep").symlink_to(outside)
    with pytest.raises(CheckpointError, match="a/b/deep: a symlink leading outside") as refused:
        check_contained(model)
    assert str(tmp_path) not in str(refused.value)


def test_read_json_object_bounds(tmp_path: Path) -> None:
    (tmp_path / "deep.json").write_text("[" * 5000 + "]" * 5000)
    (tmp_path / "nested.json").write_text(json.dumps(json.loads('{"a": ' * 100 + "1" + "}" * 100)))
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "ok.json").write_text('{"a": {"b": [1, 2]}}')
    for name, needle in (
        ("deep.json", "nested too deeply"),
        ("nested.json", "more than"),
        ("list.json", "JSON object"),
        ("missing.json", "not readable"),
    ):
        with pytest.raises(CheckpointError, match=needle):
            read_json_object(tmp_path, name)
    assert read_json_object(tmp_path, "ok.json") == {"a": {"b": [1, 2]}}


CONFIGS = [
    ModelConfig(**BASE),  # type: ignore[arg-type]
    ModelConfig(**{**BASE, "n_layers": 0}),  # type: ignore[arg-type]
    ModelConfig(
        **BASE,
        d_mlp=24,
        attn_only=False,
        act_fn="gelu",
        normalization_type="LN",
        use_bias=True,  # type: ignore[arg-type]
        positional_embedding_type="standard",
    ),
    ModelConfig(**BASE, positional_embedding_type="rotary", rotary_dim=2, normalization_type="LNPre"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["attn-only", "0-layer", "mlp-bias-ln", "rotary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_load_bytes_is_the_size_of_the_model_built(cfg: ModelConfig, dtype: torch.dtype) -> None:
    model = Transformer(cfg).to(dtype)
    built = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert load_bytes(cfg, dtype) == built


def test_load_bytes_of_an_absurd_config_costs_nothing() -> None:
    huge = ModelConfig(n_layers=MAX_LAYERS, d_model=10**6, n_heads=1, d_head=10**6, d_vocab=10**9, n_ctx=10**7)
    assert load_bytes(huge) > 2**50  # priced (meta tensors), never allocated
