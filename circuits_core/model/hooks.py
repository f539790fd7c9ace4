"""Recording and replacing activations by TransformerLens hook name: what `Transformer.run` keeps (a name filter)
and what a frozen run takes from a previous run instead of computing it (`Frozen`).

The paper's "freezing attention patterns" trick (Elhage et al. 2021, "Path Expansion"): with the patterns and
norm scales frozen, the network is linear in its input embeddings, which the path expansions stand on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import Tensor

# A name filter: None keeps nothing, a callable or a set of names keeps those.
NameFilter = Callable[[str], bool] | Iterable[str] | None


@dataclass
class Frozen:
    """Values to use instead of computing them (keys are TransformerLens hook names).

    patterns:  {"blocks.{l}.attn.hook_pattern": Tensor[batch, n_heads, q_pos, k_pos]}
    ln_scales: {"blocks.{l}.ln1.hook_scale" | "blocks.{l}.ln2.hook_scale" | "ln_final.hook_scale":
                Tensor[batch, pos, 1]}; also the output norms' ("blocks.{l}.ln1_post.hook_scale", "ln2_post") and
                QK-norm's ("blocks.{l}.attn.q_norm.hook_scale" [batch, pos, heads or 1, 1], "k_norm")
    value_resid: {layer: Tensor[batch, pos, d_model]}: residual stream that layer l's *values* read
                 (the term-importance rerun); queries and keys still read the current residual stream.
    mlp_out: {layer: Tensor[batch, pos, d_model]}: layer l's MLP output (`hook_mlp_out`), used instead of
             computing it (ln2 and the MLP are skipped, their hooks are not recorded): an MLP as a fixed node,
             as in paths.py.
    routes: {layer: (indices [batch, pos, k], weights [batch, pos, k])}: a mixture-of-experts layer's routing,
            used instead of its router (moe.py): the experts each token used and their weights, frozen like a
            norm scale.
    """

    patterns: dict[str, Tensor] = field(default_factory=dict)
    ln_scales: dict[str, Tensor] = field(default_factory=dict)
    value_resid: dict[int, Tensor] = field(default_factory=dict)
    mlp_out: dict[int, Tensor] = field(default_factory=dict)
    routes: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)


class StopRun(Exception):
    """Raised by the recorder right after it saw the `stop_after` hook (Transformer.run_until)."""


class Recorder:
    def __init__(self, names: NameFilter, stop_after: str | None = None):
        self.cache: dict[str, Tensor] = {}
        self.stop_after = stop_after
        if names is None:
            self._keep: Callable[[str], bool] = lambda _name: False
        elif callable(names):
            self._keep = names
        else:
            wanted = set(names)
            self._keep = wanted.__contains__

    def wants(self, name: str) -> bool:
        """Whether the value of hook `name` is asked for: kept, or the hook a run stops after (the layers' fast paths,
        which skip a hook's value, skip neither)."""
        return self._keep(name) or name == self.stop_after

    def __call__(self, name: str, value: Tensor) -> Tensor:
        if self._keep(name):
            self.cache[name] = value
        if name == self.stop_after:
            raise StopRun
        return value
