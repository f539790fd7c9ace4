"""The residual stream's writers and readers, each as the factors of its map into or out of the stream.

Paper section: "The Residual Stream as a Communication Channel" (Elhage et al. 2021; docs/maths.md §2.1). Row-vector
(TransformerLens) convention, x @ W. A writer maps its input into the stream, W_w [n_in, d_model]; a reader
maps the stream to its output, W_r [d_model, n_out]:

    writer   W_w                                          reader     W_r
    embed    W_E_eff [d_vocab, d]  (W_E after ln1 of L0)   L1H4.Q     W_QK   = W_Q R(offset) W_K^T [d, d]
    pos      W_pos [n_ctx, d]                              L1H4.K     W_QK^T = W_K R(offset)^T W_Q^T
    L0H3     W_OV = W_V W_O [d, d] (rank d_head)           L1H4.V     W_OV   = W_V W_O
    L0.mlp   W_out [d_mlp, d] (or chosen neurons' rows)     L1.mlp.in  W_in [d, d_mlp]  (gated: .gate W_gate,
                                                                                         .up W_in)
                                                           unembed    W_U [d, d_vocab]
    mixture of experts (moe.py), expert e of layer 0:
    L0.mlp.e5  W_out[e] [d_mlp, d]                          L0.mlp.e5.gate / .up   W_gate[e], W_in[e] [d, d_mlp]
                                                           L0.mlp.router          W_router [d, n_experts]
    DeepSeek: a layer's shared experts (always on) are one more pair, L1.mlp.shared (W_shared_out) and
    L1.mlp.shared.gate / .up; its dense first layers are dense MLPs (L0.mlp, L0.mlp.gate / .up).

A writer reaches a reader only when it writes before the reader reads (layer order; a parallel block's MLP
does not see its own attention); shortformer positions are added to the query and key inputs after ln1 of
every layer, so `pos` reaches only Q and K readers; rotary and position-free models have no `pos` writer.
Rotary Q/K readers are read at query-key offset 0 (R = I) unless an offset is chosen. GQA: model.W_K / W_V are
per query head. Weights are used as loaded (LN weight and centring inside them when processing folded them).
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass
from typing import Literal

from circuits_core.errors import InvalidInputError, NotFoundError
from circuits_core.model.head_names import head_name
from circuits_core.model.transformer import Transformer

WriterKind = Literal["embed", "pos", "head", "mlp"]
ReaderRole = Literal["Q", "K", "V", "in", "gate", "up", "router", "unembed"]


@dataclass(frozen=True)
class Writer:
    """A component that writes into the residual stream. layer/head -1 where they do not apply."""

    kind: WriterKind
    layer: int = -1
    head: int = -1
    neurons: tuple[int, ...] | None = None  # MLP only: these rows of W_out
    expert: int = -1  # mixture of experts: this expert's W_out

    @property
    def name(self) -> str:
        if self.kind in ("embed", "pos"):
            return self.kind
        if self.kind == "head":
            return head_name(self.layer, self.head)
        sel = "" if self.neurons is None else "[" + ",".join(map(str, self.neurons)) + "]"
        return f"L{self.layer}.mlp{_expert(self.expert)}{sel}"

    def slot(self) -> int:
        """Where it writes: 0 before layer 0, 2l+1 after layer l's attention, 2l+2 after its MLP."""
        return 0 if self.kind in ("embed", "pos") else 2 * self.layer + (1 if self.kind == "head" else 2)


@dataclass(frozen=True)
class Reader:
    """A component that reads the residual stream."""

    role: ReaderRole
    layer: int = -1
    head: int = -1
    neurons: tuple[int, ...] | None = None  # MLP inputs only: these columns of W_in / W_gate
    expert: int = -1  # mixture of experts: this expert's W_gate / W_in

    @property
    def name(self) -> str:
        if self.role == "unembed":
            return "unembed"
        if self.role in ("Q", "K", "V"):
            return f"{head_name(self.layer, self.head)}.{self.role}"
        sel = "" if self.neurons is None else "[" + ",".join(map(str, self.neurons)) + "]"
        return f"L{self.layer}.mlp{_expert(self.expert)}.{self.role}{sel}"

    def slot(self, model: Transformer) -> int:
        """Where it reads: layer l's attention at 2l+1, its MLP at 2l+2 (2l+1 in a parallel block), unembed last."""
        cfg = model.cfg
        if self.role == "unembed":
            return 2 * cfg.n_layers + 1
        if self.role in ("Q", "K", "V") or cfg.parallel_attn_mlp:
            return 2 * self.layer + 1
        return 2 * self.layer + 2


SHARED = -2  # the `expert` index of a layer's shared experts (DeepSeek)


def _expert(expert: int) -> str:
    return ".shared" if expert == SHARED else f".e{expert}" if expert >= 0 else ""


def reaches(model: Transformer, writer: Writer, reader: Reader) -> bool:
    """Does the reader see what the writer wrote (written earlier; shortformer positions only reach Q and K)?"""
    if writer.kind == "pos" and model.cfg.positional_embedding_type == "shortformer":
        return reader.role in ("Q", "K")
    return writer.slot() < reader.slot(model)


def earlier_writers(model: Transformer, ws: list[Writer], rs: list[Reader]) -> list[int]:
    """Per reader, how many of `ws` (in write order, as writers(model) lists them) were written before it reads."""
    slots = [w.slot() for w in ws]
    assert slots == sorted(slots), "the writers must be listed in the order they write"
    return [bisect_left(slots, r.slot(model)) for r in rs]


# -- the components of a model --------------------------------------------------------------------------
def has_pos_writer(model: Transformer) -> bool:
    return model.W_pos is not None


def mlp_roles(model: Transformer) -> tuple[ReaderRole, ...]:
    if model.cfg.attn_only:
        return ()
    return ("gate", "up") if getattr(model.cfg, "gated_mlp", False) else ("in",)


def experts(model: Transformer, layer: int) -> list[int]:
    """[-1] for a dense MLP (one writer), else every expert's index of layer `layer` (and SHARED for its shared
    experts)."""
    cfg = model.cfg
    if not cfg.layer_has_experts(layer):
        return [-1]
    return list(range(cfg.num_experts or 0)) + ([SHARED] if cfg.moe_shared_d_mlp is not None else [])


def writers(model: Transformer) -> list[Writer]:
    """embed, pos (learned positions only), then per layer its heads and its MLP (or each of its experts)."""
    cfg = model.cfg
    out = [Writer("embed")] + ([Writer("pos")] if has_pos_writer(model) else [])
    for layer in range(cfg.n_layers):
        out += [Writer("head", layer, h) for h in range(cfg.n_heads)]
        if not cfg.attn_only:
            out += [Writer("mlp", layer, expert=e) for e in experts(model, layer)]
    return out


def readers(model: Transformer) -> list[Reader]:
    """Per layer: every head's Q, then K, then V, then the MLP input(s) (each role over the experts, then the
    router); the unembedding last."""
    cfg = model.cfg
    out: list[Reader] = []
    for layer in range(cfg.n_layers):
        for role in ("Q", "K", "V"):
            out += [Reader(role, layer, h) for h in range(cfg.n_heads)]  # type: ignore[arg-type]
        out += [Reader(role, layer, expert=e) for role in mlp_roles(model) for e in experts(model, layer)]
        if cfg.layer_has_experts(layer):
            out.append(Reader("router", layer))
    return out + [Reader("unembed")]


_HEAD = r"L(\d{1,4})H(\d{1,4})"
_NEURONS = r"(?:\[(\d{1,7}(?:,\d{1,7}){0,255})\])?"
_EXPERT = r"(?:\.(e\d{1,5}|shared))?"
_WRITER_RE = re.compile(rf"^(?:(embed|pos)|{_HEAD}|L(\d{{1,4}})\.mlp{_EXPERT}{_NEURONS})$")
_READER_RE = re.compile(rf"^(?:(unembed)|{_HEAD}\.(Q|K|V)|L(\d{{1,4}})\.mlp{_EXPERT}\.(in|gate|up|router){_NEURONS})$")


def mlp_width(model: Transformer, layer: int, expert: int) -> int:
    """The hidden width of layer `layer`'s MLP (an expert's, the shared experts', a dense layer's)."""
    cfg = model.cfg
    return (cfg.moe_shared_d_mlp if expert == SHARED else cfg.layer_d_mlp(layer)) or 0


def _neurons(model: Transformer, text: str | None, d_mlp: int) -> tuple[int, ...] | None:
    if text is None:
        return None
    idx = tuple(int(n) for n in text.split(","))
    if any(n >= d_mlp for n in idx) or len(set(idx)) != len(idx):
        raise NotFoundError(f"neurons must be distinct and in [0, {d_mlp}), got {list(idx)}")
    return idx


def _check_expert(model: Transformer, layer: int, text: str | None, name: str, router: bool = False) -> int:
    """The expert index named (-1 for none, SHARED for 'shared'), checked: a mixture of experts needs one (except its
    router), a dense MLP has none."""
    E = model.cfg.num_experts if model.cfg.layer_has_experts(layer) else None
    if E is None:
        if text is not None or router:
            raise NotFoundError(f"{name}: the model's MLPs are dense (no experts, no router)")
        return -1
    if router:
        if text is not None:
            raise NotFoundError(f"{name}: the router is one per layer: L<l>.mlp.router")
        return -1
    if text is None:
        raise NotFoundError(f"{name}: the MLP is a mixture of {E} experts: name one, L<l>.mlp.e<0..{E - 1}>")
    if text == "shared":
        if model.cfg.moe_shared_d_mlp is None:
            raise NotFoundError(f"{name}: the model has no shared experts")
        return SHARED
    if int(text[1:]) >= E:
        raise NotFoundError(f"{name}: the model has {E} experts per layer")
    return int(text[1:])


def _check_layer(model: Transformer, layer: int, name: str) -> None:
    if layer >= model.cfg.n_layers:
        raise NotFoundError(f"{name}: the model has {model.cfg.n_layers} layers")


def parse_writer(model: Transformer, name: str) -> Writer:
    """'embed', 'pos', 'L0H3', 'L0.mlp' or 'L0.mlp[5,17]' -> Writer, checked against the model."""
    m = _WRITER_RE.match(name.strip()) if isinstance(name, str) else None
    if m is None:
        raise InvalidInputError(
            f"writer {name!r} is not one of embed, pos, L<l>H<h>, L<l>.mlp, L<l>.mlp[n,...], L<l>.mlp.e<expert>"
        )
    if m.group(1):
        if m.group(1) == "pos" and not has_pos_writer(model):
            raise NotFoundError(f"the model has {model.cfg.positional_embedding_type!r} positions: no pos writer")
        return Writer(m.group(1))  # type: ignore[arg-type]
    if m.group(2):
        layer, head = int(m.group(2)), int(m.group(3))
        _check_layer(model, layer, name)
        if head >= model.cfg.n_heads:
            raise NotFoundError(f"{name}: the model has {model.cfg.n_heads} heads per layer")
        return Writer("head", layer, head)
    layer = int(m.group(4))
    _check_layer(model, layer, name)
    if model.cfg.attn_only:
        raise NotFoundError(f"{name}: the model is attention-only (no MLPs)")
    expert = _check_expert(model, layer, m.group(5), name)
    return Writer("mlp", layer, neurons=_neurons(model, m.group(6), mlp_width(model, layer, expert)), expert=expert)


def parse_reader(model: Transformer, name: str) -> Reader:
    """'unembed', 'L1H4.Q|K|V', 'L1.mlp.in' (gated: 'L1.mlp.gate' / 'L1.mlp.up'), optional '[n,...]' neurons."""
    m = _READER_RE.match(name.strip()) if isinstance(name, str) else None
    if m is None:
        raise InvalidInputError(
            f"reader {name!r} is not one of unembed, L<l>H<h>.Q|K|V, L<l>.mlp.in|gate|up, "
            "L<l>.mlp.e<expert>.gate|up, L<l>.mlp.router"
        )
    if m.group(1):
        return Reader("unembed")
    if m.group(2):
        layer, head = int(m.group(2)), int(m.group(3))
        _check_layer(model, layer, name)
        if head >= model.cfg.n_heads:
            raise NotFoundError(f"{name}: the model has {model.cfg.n_heads} heads per layer")
        return Reader(m.group(4), layer, head)  # type: ignore[arg-type]
    layer, role = int(m.group(5)), m.group(7)
    _check_layer(model, layer, name)
    if role != "router" and role not in mlp_roles(model):
        raise NotFoundError(f"{name}: this model's MLP inputs are {list(mlp_roles(model)) or 'none (attention-only)'}")
    expert = _check_expert(model, layer, m.group(6), name, router=role == "router")
    if role == "router" and m.group(8) is not None:
        raise NotFoundError(f"{name}: the router reads the stream whole (no neurons)")
    neurons = _neurons(model, m.group(8), mlp_width(model, layer, expert))
    return Reader(role, layer, neurons=neurons, expert=expert)  # type: ignore[arg-type]
