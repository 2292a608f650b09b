#!/usr/bin/env bash
# Installs the binaries the operator's tests need into .tools/bin (gitignored):
#   helm      built from the Go module proxy (helm.sh/helm/v3/cmd/helm), pinned below
#   promtool, prometheus  from Debian's `prometheus` package (apt), linked into .tools/bin
#             (promtool tests the alert rules; the autoscaler's metric-source tests start a
#             real Prometheus server on 127.0.0.1 that scrapes a real engine)
#   containerd, runc, CNI plugins, buildah, debootstrap, iptables, conntrack  from Debian's
#             packages (apt): the real node of `make e2e` (e2e/realnode.py) and the image
#             builds (e2e/images.py); the Debian service is not started, the suite runs its own
#   g++       from Debian (apt): compiles the engine's CPU attention kernels once per
#             machine (src/kvpilot/kernels/cpu_attention.py); without it they fall back to torch
#   registry  go-containerregistry's in-memory OCI registry (cmd/registry), built from the Go
#             module proxy, pinned below: `kvpilot fetch-model oci://` is tested against it
#   moto_server  moto's S3 server in its own virtual environment (.tools/moto): boto3, which
#             moto needs, caps python-dateutil below what the kubernetes client needs, so it
#             cannot live in the project's environment; `kvpilot fetch-model s3://` is tested
#             against it
#   llmd-indexer  llm-d's precise prefix-cache indexer (llm-d-kv-cache-manager, the version
#             pinned in tests/interop/llmd_indexer/go.mod) behind a small HTTP API, built with
#             cgo from that Go module against Debian's libzmq3-dev (apt, with gcc and
#             pkg-config); rebuilt when the module's sources change (a content-hash stamp).
#             The engine's KV cache events are tested against it (tests/interop)
# Idempotent and fast when everything is already there (a version check per tool).
# CI runs it as root on a clean machine, so apt-get is called directly when needed.
# The Kubernetes JSON schemas used to validate rendered manifests come from the PyPI
# package kubernetes-validate (a dev extra), so no schema download is needed here.
set -euo pipefail
cd "$(dirname "$0")/.."

# Two runs at once (`make test` beside `make e2e-prepare`, or a machine's own apt job)
# wait for dpkg's and apt's locks instead of failing at once.
apt-get() { command apt-get -o DPkg::Lock::Timeout=600 "$@"; }

HELM_VERSION="v3.22.0"
GGCR_VERSION="v0.22.1"
MOTO_VERSION="5.2.5"
TOOLS_BIN="$PWD/.tools/bin"
mkdir -p "$TOOLS_BIN"

log() { echo "install-tools: $*" >&2; }

find_go() {
  if command -v go >/dev/null 2>&1; then command -v go
  elif [ -x /usr/local/go/bin/go ]; then echo /usr/local/go/bin/go
  else log "Go is required to build helm, the registry and llmd-indexer (looked on PATH and /usr/local/go/bin)"; exit 1
  fi
}

install_helm() {
  if [ -x "$TOOLS_BIN/helm" ] && "$TOOLS_BIN/helm" version --template '{{.Version}}' 2>/dev/null \
      | grep -qx "$HELM_VERSION"; then
    return
  fi
  local go; go="$(find_go)"
  log "building helm $HELM_VERSION from the Go module proxy (a few minutes on a cold cache)"
  # Version ldflags make `helm version` report the release instead of the module default.
  GOBIN="$TOOLS_BIN" CGO_ENABLED=0 "$go" install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
}

install_prometheus() {
  # Both binaries come from the one Debian package; the package's service is not started
  # in containers without systemd, and the tests run their own server on a free port.
  if [ -x "$TOOLS_BIN/promtool" ] && "$TOOLS_BIN/promtool" --version >/dev/null 2>&1 \
      && [ -x "$TOOLS_BIN/prometheus" ] && "$TOOLS_BIN/prometheus" --version >/dev/null 2>&1; then
    return
  fi
  if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    log "installing Debian package prometheus (promtool and the prometheus server)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  fi
  ln -sf "$(command -v promtool)" "$TOOLS_BIN/promtool"
  ln -sf "$(command -v prometheus)" "$TOOLS_BIN/prometheus"
}

install_registry() {
  if [ -x "$TOOLS_BIN/registry" ] && [ -f "$TOOLS_BIN/.registry-$GGCR_VERSION" ]; then
    return
  fi
  local go; go="$(find_go)"
  log "building the OCI test registry (go-containerregistry $GGCR_VERSION cmd/registry)"
  GOBIN="$TOOLS_BIN" CGO_ENABLED=0 "$go" install -trimpath -ldflags "-s -w" \
    "github.com/google/go-containerregistry/cmd/registry@$GGCR_VERSION"
  touch "$TOOLS_BIN/.registry-$GGCR_VERSION"
}

install_moto() {
  local venv="$PWD/.tools/moto"
  if [ -x "$venv/bin/moto_server" ] && "$venv/bin/python" -c "import moto, sys; sys.exit(moto.__version__ != '$MOTO_VERSION')" 2>/dev/null; then
    ln -sf "$venv/bin/moto_server" "$TOOLS_BIN/moto_server"
    return
  fi
  log "installing moto $MOTO_VERSION (S3 test server) into .tools/moto"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "moto[server]==$MOTO_VERSION"
  ln -sf "$venv/bin/moto_server" "$TOOLS_BIN/moto_server"
}

NODE_PACKAGES=(containerd runc containernetworking-plugins buildah debootstrap iptables conntrack g++)
install_node_packages() {
  local missing=()
  for pkg in "${NODE_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -eq 0 ]; then return; fi
  log "installing Debian packages ${missing[*]} (the e2e node and image builds)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # policy-rc.d 101: the packages' services are not started (the suite runs its own).
  local policy=/usr/sbin/policy-rc.d created=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; created=1; fi
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [ "$created" = 1 ]; then rm -f "$policy"; fi
}

# The helper links libzmq through cgo (github.com/pebbe/zmq4), found by pkg-config.
LLMD_INDEXER_SRC="tests/interop/llmd_indexer"
LLMD_INDEXER_PACKAGES=(libzmq3-dev pkg-config gcc)
install_llmd_indexer() {
  local bin="$TOOLS_BIN/llmd-indexer" stamp="$TOOLS_BIN/.llmd-indexer.sha256" sum
  # The stamp is a hash of the module's sources (paths and contents), so an edit to
  # main.go, go.mod or go.sum rebuilds; `-h` checks the binary still finds libzmq.
  sum="$(cd "$LLMD_INDEXER_SRC" && find . -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) \
    | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)"
  if [ -x "$bin" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ] && "$bin" -h >/dev/null 2>&1; then
    return
  fi
  local missing=()
  for pkg in "${LLMD_INDEXER_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "installing Debian packages ${missing[*]} (llmd-indexer links libzmq)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  local go; go="$(find_go)"
  log "building llmd-indexer from $LLMD_INDEXER_SRC (llm-d-kv-cache-manager; up to 8 minutes on a cold Go cache)"
  rm -f "$stamp"
  (cd "$LLMD_INDEXER_SRC" && CGO_ENABLED=1 "$go" build -trimpath -ldflags "-s -w" -o "$bin" .)
  echo "$sum" >"$stamp"
}

install_helm
install_prometheus
install_registry
install_moto
install_node_packages
install_llmd_indexer
log "ok: $(containerd --version | awk '{print $3}') containerd, $(buildah --version | awk '{print $3}') buildah, $("$TOOLS_BIN/helm" version --template '{{.Version}}'), promtool $("$TOOLS_BIN/promtool" --version 2>&1 | head -1 | awk '{print $3}'), prometheus $("$TOOLS_BIN/prometheus" --version 2>&1 | head -1 | awk '{print $3}')"
