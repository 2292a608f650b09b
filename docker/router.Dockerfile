# syntax=docker/dockerfile:1
# The request router in front of an InferenceDeployment's engine pods: vllm-router (the
# vLLM project's Rust proxy, shipped as a wheel with a Python launcher), at the release
# pyproject.toml's `router` extra pins. Nothing of this repository goes in: the operator
# starts it with every flag on the command line (src/kvpilot/operator/builders/router.py).
# Build from the repository root:
#   docker build -f docker/router.Dockerfile -t kvpilot/router:0.1.0 .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

RUN pip install "vllm-router==0.1.17" \
    && groupadd --gid 10001 router \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin router

WORKDIR /tmp
# The operator runs this as user 10001 with a read-only root filesystem (emptyDirs on /tmp
# and /cache, where HF_HOME points for the tokenizer kv_aware loads).
USER 10001:10001
# 8000: the OpenAI-compatible API (and /liveness, /readiness); 29000: Prometheus metrics.
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
