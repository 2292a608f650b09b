#!/usr/bin/env bash
# Builds the control-plane binaries `make e2e` and `make demo` run, once, into a cache
# outside the repo: ~/.cache/kvpilot/k8s/<version>/bin (override with KVPILOT_K8S_CACHE).
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy
#               k8s.io/kubernetes $K8S_VERSION (the node's two run the real-node e2e)
#   etcd        go.etcd.io/etcd/server/v3 $ETCD_VERSION
#   prometheus  github.com/prometheus/prometheus $PROM_MODULE_VERSION; Debian's package
#               lacks Kubernetes service discovery, which the e2e Prometheus needs
# Everything comes from the Go module proxy through throwaway wrapper modules (no git
# clones, no release tarballs). kubernetes' own go.mod points k8s.io/* at ./staging with
# v0.0.0 requirements; the wrapper replaces each with the matching v0.<minor>.<patch> tag.
# Idempotent: a binary that is present and answers --version is not rebuilt.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
PROM_MODULE_VERSION="${PROM_MODULE_VERSION:-v0.316.0}"   # Prometheus 3.16.0

CACHE="${KVPILOT_K8S_CACHE:-$HOME/.cache/kvpilot/k8s/$K8S_VERSION}"
BIN="$CACHE/bin"
WORK="$CACHE/src"
mkdir -p "$BIN" "$WORK"

log() { echo "build-k8s: $*" >&2; }

find_go() {
  if command -v go >/dev/null 2>&1; then command -v go
  elif [ -x /usr/local/go/bin/go ]; then echo /usr/local/go/bin/go
  else log "Go is required (looked on PATH and /usr/local/go/bin)"; exit 1
  fi
}
GO="$(find_go)"
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local

have() { [ -x "$BIN/$1" ] && "$BIN/$1" --version >/dev/null 2>&1; }

build_kubernetes() {
  if have kube-apiserver && have kube-controller-manager && have kube-scheduler \
      && have kubelet && have kube-proxy; then return; fi
  local dir="$WORK/kubernetes" minor patch major
  major="${K8S_VERSION#v}"; major="${major%%.*}"
  minor="${K8S_VERSION#v*.}"; minor="${minor%%.*}"
  patch="${K8S_VERSION##*.}"
  mkdir -p "$dir"
  local modfile
  modfile="$(cd "$dir" && "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
  {
    echo "module kvpilot.local/k8s-build"
    echo
    echo "go $(awk '$1 == "go" {print $2; exit}' "$modfile")"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    # Every staging module kubernetes requires as v0.0.0 is published as v0.<minor>.<patch>.
    awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$modfile" | sort -u \
      | while read -r m; do echo "replace $m => $m v0.$minor.$patch"; done
  } >"$dir/go.mod"
  cat >"$dir/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
GO
  local ld="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    ld="$ld -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  log "building kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy $K8S_VERSION (cold: tens of minutes on 2 cores)"
  (cd "$dir" && "$GO" build -trimpath -tags=selinux,notest,grpcnotrace -ldflags "$ld" -o "$BIN/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy)
}

build_etcd() {
  if have etcd; then return; fi
  local dir="$WORK/etcd"
  mkdir -p "$dir"
  cat >"$dir/go.mod" <<MOD
module kvpilot.local/etcd-build

go 1.24

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
MOD
  log "building etcd $ETCD_VERSION"
  (cd "$dir" && "$GO" build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3)
}

build_prometheus() {
  if have prometheus; then return; fi
  local dir="$WORK/prometheus"
  mkdir -p "$dir"
  cat >"$dir/go.mod" <<MOD
module kvpilot.local/prometheus-build

go 1.24

require github.com/prometheus/prometheus $PROM_MODULE_VERSION
MOD
  # Only the service discovery we use (the cloud SDKs are most of a full build); no UI.
  log "building prometheus (module $PROM_MODULE_VERSION, Kubernetes service discovery only)"
  # Module v0.316.0 is Prometheus 3.16.0: `prometheus --version` says so.
  local minor="${PROM_MODULE_VERSION#v0.}"; minor="${minor%%.*}"
  local ld="-s -w -X github.com/prometheus/common/version.Version=${minor:0:1}.${minor:1}.${PROM_MODULE_VERSION##*.}"
  (cd "$dir" && "$GO" build -trimpath -tags=remove_all_sd,enable_kubernetes_sd -ldflags "$ld" \
    -o "$BIN/prometheus" \
    github.com/prometheus/prometheus/cmd/prometheus)
}

build_kubernetes
build_etcd
build_prometheus
log "ok: $BIN ($("$BIN/kube-apiserver" --version), etcd $("$BIN/etcd" --version | awk 'NR==1{print $3}'))"
