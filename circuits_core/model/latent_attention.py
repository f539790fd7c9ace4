"""Multi-head latent attention (MLA: DeepSeek-V2 and V3), row vectors, the paper's names (DeepSeek-V2, §2.1).

A query latent and one key/value latent shared by every head, each RMS-normalised, are decompressed per head; a
rotary key part, also shared by every head, is read straight from the stream:
    c_Q = RMSNorm_Γq(x W_DQ)   [rank q_rank]       q_C^h = c_Q W_UQ^h [d_nope]    q_R^h = c_Q W_QR^h [d_rope]
    c_KV = RMSNorm_Γkv(x W_DKV) [rank kv_rank]     k_C^h = c_KV W_UK^h [d_nope]   v^h = c_KV W_UV^h [d_v]
    k_R = x W_KR [d_rope], one for every head      score = (q_C k_Cᵀ + q_R R(i - j) k_Rᵀ) / attn_scale
Without a query latent (mla_q_rank None: DeepSeek-V2-Lite) c_Q is x itself, not normalised. Writing
ρ_q(i), ρ_kv(j) for the latent RMS (sqrt(mean(c²) + eps)), the score is one position-free content form and one rotary
form (circuits/latent_attention.py; docs/maths.md §7.5):
    x̂ᵢ A_h x̂ⱼᵀ / (ρ_q(i) ρ_kv(j)) + x̂ᵢ C_h R Dᵀ x̂ⱼᵀ / ρ_q(i),   A_h = W_DQ Γq W_UQ^h W_UK^hᵀ Γkv W_DKVᵀ,
    C_h = W_DQ Γq W_QR^h, D = W_KR.

Stored parameters (blocks.{l}.attn.*): W_DQ [d_model, q_rank] and q_latent_norm.w [q_rank] (with a query latent),
W_UQ [n_heads, q_rank or d_model, d_nope], W_QR [n_heads, q_rank or d_model, d_rope], W_DKV [d_model, kv_rank],
kv_latent_norm.w [kv_rank], W_KR [d_model, d_rope], W_UK [n_heads, kv_rank, d_nope], W_UV [n_heads, kv_rank, d_v],
W_O [n_heads, d_head, d_model] (rows from d_v on are zero). The engine's per-head interface (W_Q, W_K, W_V: the
effective [n_heads, d_model, d_head] weights with the gains folded and ρ taken as 1) lays q and k out as
[rope | nope | zeros] and v as [v | zeros], so the rotation turns the first rotary_dim dims (rope.py's partial
rotary) and hook_q, hook_k, hook_v, hook_z keep TransformerLens's shapes. transformers' DeepSeek latent norms use
eps 1e-6 whatever rms_norm_eps says (LATENT_EPS).

Hooks: blocks.{l}.attn.q_latent_norm.hook_scale and kv_latent_norm.hook_scale [batch, pos, 1] (ρ_q, ρ_kv), which a
frozen run may replace (hooks.Frozen.ln_scales), so with patterns and these frozen the layer is linear in its input.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from circuits_core.errors import InvalidInputError
from circuits_core.model.attention import Attention
from circuits_core.model.config import ModelConfig
from circuits_core.model.hooks import Frozen, Recorder
from circuits_core.model.linear import affine

LATENT_EPS = 1e-6


class LatentNorm(nn.Module):
    """RMSNorm of a latent [batch, pos, rank] with gain w [rank]; hook_scale [batch, pos, 1] is ρ (frozen runs may
    replace it)."""

    def __init__(self, name: str, rank: int):
        super().__init__()
        self.name = name
        self.w = nn.Parameter(torch.ones(rank))

    def scale(self, c: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        """ρ [batch, pos, 1] of latents c [batch, pos, rank] (the frozen one when the run has it)."""
        key = f"{self.name}.hook_scale"
        if frozen is not None and key in frozen.ln_scales:
            return rec(key, frozen.ln_scales[key])
        return rec(key, (c.pow(2).mean(-1, keepdim=True) + LATENT_EPS).sqrt())

    def forward(self, c: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        return c / self.scale(c, rec, frozen) * self.w


class LatentAttention(Attention):
    """Attention heads reading a query latent and a shared key/value latent (module docstring)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        nn.Module.__init__(self)  # not Attention's: it would register per-head W_Q, W_K, W_V, which MLA computes
        assert cfg.mla_kv_rank is not None
        self.cfg, self.layer = cfg, layer
        H, d, dh, r_kv = cfg.n_heads, cfg.d_model, cfg.d_head, cfg.mla_kv_rank
        d_rope, d_nope, d_v = cfg.rotary_dim or 0, cfg.mla_d_nope, cfg.mla_d_v
        r_q = cfg.mla_q_rank if cfg.mla_q_rank is not None else d
        prefix = f"blocks.{layer}.attn"
        if cfg.mla_q_rank is not None:
            self.W_DQ = nn.Parameter(torch.empty(d, r_q))
            self.q_latent_norm = LatentNorm(f"{prefix}.q_latent_norm", r_q)
        self.W_UQ = nn.Parameter(torch.empty(H, r_q, d_nope))
        self.W_QR = nn.Parameter(torch.empty(H, r_q, d_rope))
        self.W_DKV = nn.Parameter(torch.empty(d, r_kv))
        self.kv_latent_norm = LatentNorm(f"{prefix}.kv_latent_norm", r_kv)
        self.W_KR = nn.Parameter(torch.empty(d, d_rope))
        self.W_UK = nn.Parameter(torch.empty(H, r_kv, d_nope))
        self.W_UV = nn.Parameter(torch.empty(H, r_kv, d_v))
        self.W_O = nn.Parameter(torch.empty(H, dh, d))

    # -- the latents --------------------------------------------------------------------------------------------
    def query_latent(self, x: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        """c_Q [batch, pos, q_rank] (x itself without a query latent)."""
        if self.cfg.mla_q_rank is None:
            return x
        return self.q_latent_norm(affine(x, self.W_DQ), rec, frozen)

    def kv_latent(self, x: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        """c_KV [batch, pos, kv_rank]."""
        return self.kv_latent_norm(affine(x, self.W_DKV), rec, frozen)

    def _laid_out(self, rope: Tensor | None, content: Tensor) -> Tensor:
        """[..., H, d_head]: [rope | content | zeros] (rope [..., H or 1, d_rope] broadcast over the heads)."""
        parts = [content] if rope is None else [rope.expand(*content.shape[:-1], rope.shape[-1]), content]
        width = sum(p.shape[-1] for p in parts)
        if width < self.cfg.d_head:
            parts.append(content.new_zeros(*content.shape[:-1], self.cfg.d_head - width))
        return torch.cat(parts, dim=-1)

    def queries_keys(self, q_in: Tensor, k_in: Tensor, rec: Recorder, frozen: Frozen | None) -> tuple[Tensor, Tensor]:
        # q_in, k_in [batch, pos, d_model] -> q, k [batch, pos, n_heads, d_head], laid out [rope | nope | 0]
        c_q = self.query_latent(q_in, rec, frozen)  # [batch, pos, q_rank]
        q = self._laid_out(torch.einsum("bpr,hre->bphe", c_q, self.W_QR), torch.einsum("bpr,hre->bphe", c_q, self.W_UQ))
        c_kv = self.kv_latent(k_in, rec, frozen)  # [batch, pos, kv_rank]
        k_rope = affine(k_in, self.W_KR)[:, :, None]  # [batch, pos, 1, d_rope]: one for every head
        k = self._laid_out(k_rope, torch.einsum("bpr,hre->bphe", c_kv, self.W_UK))
        return q, k

    def values(self, v_in: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        # v_in [batch, pos, d_model] -> v [batch, pos, n_heads, d_head], laid out [v | 0]
        c_kv = self.kv_latent(v_in, Recorder(None), frozen)  # ρ_kv recorded once, by the keys
        return self._laid_out(None, torch.einsum("bpr,hre->bphe", c_kv, self.W_UV))

    def latent_rho(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(ρ_q, ρ_kv) [...] of normalised residuals x [..., d_model] as the latent norms measure them (ρ_q ≡ 1
        without a query latent)."""
        rho_kv = (affine(x, self.W_DKV).pow(2).mean(-1) + LATENT_EPS).sqrt()
        if self.cfg.mla_q_rank is None:
            return torch.ones_like(rho_kv), rho_kv
        return (affine(x, self.W_DQ).pow(2).mean(-1) + LATENT_EPS).sqrt(), rho_kv

    def scale_keys(self, k: Tensor, rho_kv: Tensor) -> Tensor:
        """Keys k [..., n, d_head] in the effective layout with their content dims divided by ρ_kv [n] (the rotary
        dims are not normalised): the exact key of each row (a new tensor)."""
        rd = self.cfg.rotary_dim or 0
        out = k.clone()
        out[..., rd : rd + self.cfg.mla_d_nope] /= rho_kv[:, None]
        return out

    # -- the engine's per-head interface: effective weights, gains folded, ρ taken as 1 -------------------------
    def query_reader(self) -> Tensor:
        """W_DQ Γq [d_model, q_rank] (the identity [d_model, d_model] without a query latent)."""
        if self.cfg.mla_q_rank is None:
            return torch.eye(self.cfg.d_model, dtype=self.W_UQ.dtype, device=self.W_UQ.device)
        return self.W_DQ * self.q_latent_norm.w

    def kv_reader(self) -> Tensor:
        """W_DKV Γkv [d_model, kv_rank]: every head's content keys and values read the stream through it."""
        return self.W_DKV * self.kv_latent_norm.w

    @property
    def W_Q(self) -> Tensor:  # type: ignore[override]
        """[n_heads, d_model, d_head]: [W_DQ Γq W_QR^h | W_DQ Γq W_UQ^h | 0]."""
        if self.cfg.mla_q_rank is None:  # the up-projections read the stream themselves
            return self._laid_out(self.W_QR, self.W_UQ)  # [H, d, dh]
        read = self.query_reader()
        return self._laid_out(read @ self.W_QR, read @ self.W_UQ)  # [H, d, dh]

    @property
    def W_K(self) -> Tensor:  # type: ignore[override]
        """[n_heads, d_model, d_head]: [W_KR | W_DKV Γkv W_UK^h | 0]."""
        content = self.kv_reader() @ self.W_UK  # [H, d, d_nope]
        return self._laid_out(self.W_KR.expand(content.shape[0], -1, -1), content)

    @property
    def W_V(self) -> Tensor:  # type: ignore[override]
        """[n_heads, d_model, d_head]: [W_DKV Γkv W_UV^h | 0]."""
        return self._laid_out(None, self.kv_reader() @ self.W_UV)

    def grouped(self, name: str) -> Tensor:
        if name in ("W_K", "W_V"):
            return self.W_K if name == "W_K" else self.W_V
        raise InvalidInputError(f"the model has no {name}")
