"""The one Settings object of the app (pydantic-settings, environment prefix `QKOV_`).

Nothing else in qkov reads the environment: `create_app(Settings(...))` builds an app on any folder of
models without monkeypatching. Nested limits read `QKOV_LIMITS__MAX_K=100` style variables.

The device (`QKOV_DEVICE`: auto, cpu, cuda, cuda:N) is resolved in one place, `Settings.compute_device`, and
`Settings.on_device` gives the settings an app serves with: on a GPU the request and model budgets are the GPU's
(`gpu_peak_bytes`, `gpu_max_model_bytes`, `gpu_flops_per_s`), on the CPU the host's (`limits.peak_bytes`,
`max_model_bytes`, `compute_flops_per_s`), so every price is compared with the memory of the device computing it.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from circuits_core.formats.load_watchdog import LOAD_MEMORY_ALLOWANCE, LOAD_MEMORY_MULTIPLE

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
GiB = 1024 * MiB


class Limits(BaseModel):
    """Per-request budgets; each appears as a constraint in the OpenAPI schema."""

    max_prompt_tokens: int = Field(default=256, ge=1, description="longest prompt (also capped by the model's n_ctx)")
    max_k: int = Field(default=200, ge=1, description="largest top-k")
    max_order: int = Field(default=3, ge=1, description="highest path order of the path expansions")
    max_heads: int = Field(default=16, ge=1, description="most heads in one request")
    max_batch: int = Field(default=32, ge=1, description="most sequences in a detector run")
    max_seq_len: int = Field(default=200, ge=1, description="longest repeated segment in a detector run")
    matrix_budget_bytes: int = Field(default=256 * MiB, ge=1024, description="working memory of a streamed top-k")
    peak_bytes: int = Field(  # 3 GiB: the heads table of a 262k-token vocabulary (Gemma 3) prices at 1.8 GiB
        default=3 * GiB, ge=1024, description="working memory of one request, priced before it runs"
    )
    max_answer_bytes: int = Field(default=16 * MiB, ge=1024, description="largest encoded JSON answer")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QKOV_", env_nested_delimiter="__", extra="ignore")

    models_dir: Path | None = Field(
        default=None, description="folder whose sub-folders holding a checkpoint are models"
    )
    shipped_dir: Path = Field(default=REPO_ROOT / "checkpoints", description="the shipped toy models")
    dtype: Literal["float32", "float64"] = Field(
        default="float32", description="the dtype weights are computed in (and kept in, unless half_weights keeps them)"
    )
    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="where models are loaded and computed: auto (a GPU when torch sees one, else the CPU), cpu, "
        "cuda or cuda:N",
    )
    half_weights: Literal["auto", "keep", "convert"] = Field(
        default="auto",
        description="bf16/fp16 checkpoints: keep the weights in their stored dtype (computed in float32) or convert "
        "them to `dtype` when loading; auto keeps them on a GPU and converts them on the CPU (the CPU's products "
        "are fastest on float32 weights)",
    )
    gpu_peak_bytes: int = Field(
        default=16 * GiB, ge=1024, description="working memory of one request on a GPU (limits.peak_bytes: on the CPU)"
    )
    gpu_max_model_bytes: int = Field(
        default=64 * GiB, ge=MiB, description="largest model served on a GPU: bytes of the weights it loads"
    )
    gpu_flops_per_s: float = Field(
        default=20e12,
        gt=0,
        description="arithmetic rate assumed for one computation on a GPU when pricing its time (compute_flops_per_s: "
        "on the CPU); 20 TFLOP/s is a fraction of an H100's float32 (TF32) products, shared by the compute slots",
    )
    limits: Limits = Field(default_factory=Limits)
    compute_slots: int = Field(default=2, ge=1, description="concurrent heavy computations")
    slot_wait_s: float = Field(default=30.0, gt=0, description="how long a request waits for a compute slot")
    cache_bytes: int = Field(default=256 * MiB, ge=0, description="byte budget of the result cache")
    store_url: str = Field(
        default="disk",
        pattern=r"^(off|disk|(redis|rediss|unix)://.+)$",
        description="second-level result store: 'disk' (diskcache folder shared by this machine's workers, kept across "
        "restarts), a redis:// URL (shared by replicas, disk as fallback) or 'off'",
    )
    store_dir: Path = Field(default=REPO_ROOT / ".store", description="folder of the disk store")
    store_bytes: int = Field(
        default=1024 * MiB, ge=MiB, description="byte budget of the disk store (least recently used evicted)"
    )
    store_secret: SecretStr | None = Field(
        default=None,
        description="key of the HMAC-SHA256 that authenticates every answer and page kept in the result store "
        "(QKOV_STORE_SECRET): the same on every replica and across restarts, at least 32 characters, never kept in "
        "the store. A row failing the check is recomputed. Unset: the disk store uses a key kept in a file beside its "
        "folder (QKOV_STORE_DIR + '.key', this machine only) and Redis is not used (said on /readyz and in the log)",
        min_length=32,
    )
    store_ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0, description="how long Redis keeps an answer")
    preload: bool = Field(default=False, description="load every model at start-up instead of on first use")
    max_model_bytes: int = Field(
        default=4096 * MiB, ge=MiB,
        description="largest model served: bytes of its files and of its parameters priced from config.json before "
                    "loading",
    )  # fmt: skip
    load_memory_multiple: float = Field(
        default=LOAD_MEMORY_MULTIPLE,
        gt=0,
        description="a model's load may add at most this many times its weights (in the compute dtype, dequantised) "
        "plus load_memory_allowance_bytes to the process's memory; over it the load is refused for that model "
        "(circuits_core/formats/load_watchdog.py)",
    )
    load_memory_allowance_bytes: int = Field(
        default=LOAD_MEMORY_ALLOWANCE, ge=0, description="what a load may add on top of load_memory_multiple x weights"
    )
    listing_wait_s: float = Field(
        default=5.0,
        ge=0,
        description="the model listing, / and /readyz wait at most this long for the loads of the user's model "
        "folders they start; a folder still loading then is shown as loading (its load goes on in the background)",
    )
    load_retry_s: float = Field(
        default=60.0,
        gt=0,
        description="a load refused by its memory watchdog is tried again after this long (the watchdog measures the "
        "whole process, so other work beside the load may have caused it)",
    )
    # serving (app/scheduling/, app/observability.py, app/serving_middleware.py, app/ratelimit.py)
    torch_threads: int | None = Field(default=None, ge=1, description="torch threads (default: cores // compute_slots)")
    request_timeout_s: float | None = Field(
        default=120.0,
        gt=0,
        description="a request waiting longer for its computation gets 503 and the computation stops",
    )
    compute_flops_per_s: float = Field(
        default=20e9,
        gt=0,
        description="arithmetic rate assumed for one computation when pricing its time (engine-counted FLOPs / this): "
        "20 GFLOP/s, about a third of one core's float32 matrix products on the 2-core development machine, which a "
        "computation shares with others",
    )
    inline_budget_s: float = Field(
        default=3.0,
        gt=0,
        description="a request priced at most this many seconds is answered within the request; a longer one runs as "
        "a job that its page (or API client) polls for progress",
    )
    job_budget_s: float = Field(
        default=600.0,
        gt=0,
        description="the longest a computation may be priced at: a request over it is refused (422) before it runs, "
        "naming the parameter to lower",
    )
    job_abandon_s: float = Field(
        default=15.0,
        gt=0,
        description="a job that no reader has polled for this long is stopped (the reader left)",
    )
    rate_limit: int | None = Field(default=None, ge=1, description="requests per client per rate_window_s (None: off)")
    rate_window_s: float = Field(default=60.0, gt=0, description="window of the per-client rate limit")
    rate_limit_timeout_s: float = Field(
        default=0.1,
        gt=0,
        description="longest a request waits for the rate limiter's storage (Redis); past it the request is let "
        "through or refused as rate_limit_fail_open says. The wait runs off the event loop, so a stalled Redis never "
        "stalls other requests",
    )
    rate_limit_fail_open: bool = Field(
        default=True,
        description="when the limiter's storage does not answer within rate_limit_timeout_s: true lets the request "
        "through (availability first), false answers 503 with Retry-After (the limit first)",
    )
    metrics_networks: list[str] | None = Field(
        default=None,
        description="addresses or networks (CIDR) allowed to read /metrics; others get 404. None: public; "
        "['127.0.0.1', '::1']: the machine itself only",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or networks (CIDR) of reverse proxies whose X-Forwarded-For is believed; empty: none",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a connection that has not sent a whole request head by then is closed (app/serve.py)",
    )
    shutdown_drain_s: float = Field(
        default=8.0, gt=0, description="on SIGTERM, in-flight requests get this long to finish (app/serve.py)"
    )
    log_format: Literal["json", "text"] = Field(default="json", description="JSON lines or plain text logs")
    metrics_multiprocess: bool = Field(
        default=False, description="aggregate metrics of uvicorn workers (PROMETHEUS_MULTIPROC_DIR)"
    )

    def compute_device(self) -> torch.device:
        """The device models load onto and compute on (`device` resolved: auto is a GPU when torch sees one). A GPU
        asked for but not present is a ValueError naming what torch sees."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (device.index or 0) >= count:
                raise ValueError(f"QKOV_DEVICE={self.device}: torch sees {count} CUDA device(s)")
        return device

    def keeps_half_weights(self) -> bool:
        """Whether bf16/fp16 checkpoints keep their stored dtype (half_weights; auto: on a GPU)."""
        if self.half_weights == "auto":
            return self.compute_device().type == "cuda"
        return self.half_weights == "keep"

    def on_device(self) -> Settings:
        """These settings with the budgets of the device computing (see the module docstring); the CPU's unchanged."""
        if self.compute_device().type == "cpu":
            return self
        limits = self.limits.model_copy(update={"peak_bytes": self.gpu_peak_bytes})
        return self.model_copy(
            update={
                "limits": limits,
                "max_model_bytes": self.gpu_max_model_bytes,
                "compute_flops_per_s": self.gpu_flops_per_s,
            }
        )

    @field_validator("trusted_proxies", "metrics_networks")
    @classmethod
    def _networks(cls, value: list[str] | None) -> list[str] | None:
        """Each entry an IP address or CIDR network (a typo would silently trust nothing, or the wrong peer)."""
        for entry in value or []:
            try:
                ipaddress.ip_network(entry.strip(), strict=False)
            except ValueError as exc:
                raise ValueError(f"{entry!r} is not an IP address or network ({exc})") from exc
        return value
