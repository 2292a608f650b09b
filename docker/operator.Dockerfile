# syntax=docker/dockerfile:1
# The kvpilot operator (Kopf). No torch, no engine: only the `operator` extra, so the
# image stays small (import-linter keeps kvpilot.operator off the engine's imports).
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t kvpilot/operator:0.1.0 .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# Installs this project; its dependency ranges live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[operator]" \
    && rm -rf /src \
    && groupadd --gid 10001 kvpilot \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvpilot

WORKDIR /tmp
# The chart runs this as user 10001 with a read-only root filesystem.
USER 10001:10001
EXPOSE 9090 8080
ENTRYPOINT ["kvpilot", "operator"]
