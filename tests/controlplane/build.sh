#!/usr/bin/env bash
# Builds the real control plane that the integration tests run against: kube-apiserver,
# kube-controller-manager, kube-scheduler and kubectl (k8s.io/kubernetes), etcd, kwok, the KubeRay
# operator and helm, all from their Go modules (no prebuilt downloads are reachable here), plus
# Prometheus/promtool from Debian.
#
# Idempotent: binaries land in ~/.cache/rlkube/controlplane/<versions-key>/bin and only the
# missing ones are built, so a warm run exits in about a second. The Go module and build caches stay
# in their default places so that a rebuild (a new versions key) reuses them.
#
# Environment: RLKUBE_CONTROLPLANE_CACHE overrides ~/.cache/rlkube/controlplane;
# RLKUBE_SKIP_PROMETHEUS=1 skips the Debian install (for machines without apt).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../../scripts/debian_install.sh
source "$HERE/../../scripts/debian_install.sh"
set -a
# shellcheck source=versions.env
source "$HERE/versions.env"
set +a

KEY="k8s-${KUBERNETES_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_kuberay-${KUBERAY_VERSION}_helm-${HELM_VERSION}"
CACHE_ROOT="${RLKUBE_CONTROLPLANE_CACHE:-$HOME/.cache/rlkube/controlplane}"
DEST="$CACHE_ROOT/$KEY"
BIN="$DEST/bin"

# name | wrapper module dir | main package
TOOLS=(
  "kube-apiserver|kubernetes|k8s.io/kubernetes/cmd/kube-apiserver"
  "kube-controller-manager|kubernetes|k8s.io/kubernetes/cmd/kube-controller-manager"
  "kube-scheduler|kubernetes|k8s.io/kubernetes/cmd/kube-scheduler"
  "kubectl|kubernetes|k8s.io/kubernetes/cmd/kubectl"
  "etcd|etcd|go.etcd.io/etcd/server/v3"
  "kwok|kwok|sigs.k8s.io/kwok/cmd/kwok"
  "kuberay-operator|kuberay|github.com/ray-project/kuberay/ray-operator"
  "helm|helm|helm.sh/helm/v3/cmd/helm"
)

# Manifests the harness applies, copied out of the module cache: kwok's Stage CRDs and stage sets,
# KubeRay's CRDs. "dest dir under $DEST | wrapper module dir | module | dir inside the module".
ASSETS=(
  "kwok/crd|kwok|sigs.k8s.io/kwok|kustomize/crd/bases"
  "kwok/stage/pod-fast|kwok|sigs.k8s.io/kwok|kustomize/stage/pod/fast"
  "kwok/stage/pod-chaos|kwok|sigs.k8s.io/kwok|kustomize/stage/pod/chaos"
  "kwok/stage/node-fast|kwok|sigs.k8s.io/kwok|kustomize/stage/node/fast"
  "kwok/stage/node-heartbeat|kwok|sigs.k8s.io/kwok|kustomize/stage/node/heartbeat"
  "kuberay/crd|kuberay|github.com/ray-project/kuberay/ray-operator|config/crd/bases"
)

log() { printf '[controlplane] %s\n' "$*"; }

check_pins() {
  # versions.env is the one place of truth; the go.mod files must agree with it.
  local pairs=(
    "kubernetes|k8s.io/kubernetes $KUBERNETES_VERSION"
    "etcd|go.etcd.io/etcd/server/v3 $ETCD_VERSION"
    "kwok|sigs.k8s.io/kwok $KWOK_VERSION"
    "kuberay|github.com/ray-project/kuberay/ray-operator $KUBERAY_VERSION"
    "helm|helm.sh/helm/v3 $HELM_VERSION"
  )
  local p dir want
  for p in "${pairs[@]}"; do
    dir="${p%%|*}"; want="${p#*|}"
    if ! grep -qF "$want" "$HERE/$dir/go.mod"; then
      echo "tests/controlplane/$dir/go.mod does not require '$want' (versions.env says so): update one of them and run 'go mod tidy' in tests/controlplane/$dir" >&2
      exit 1
    fi
  done
}

missing_tools() {
  local t name
  for t in "${TOOLS[@]}"; do
    name="${t%%|*}"
    [[ -x "$BIN/$name" ]] || echo "$name"
  done
}

missing_assets() {
  local a
  for a in "${ASSETS[@]}"; do
    [[ -d "$DEST/${a%%|*}" ]] || echo "$a"
  done
}

need_prometheus() {
  [[ "${RLKUBE_SKIP_PROMETHEUS:-0}" != 1 ]] && ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1
}

ldflags_for() {
  local name="$1" v
  case "$name" in
    kube-*|kubectl)
      # What Kubernetes' hack/lib/version.sh stamps, so that /version and kubectl report v1.34.x.
      v="${KUBERNETES_VERSION#v}"
      local major="${v%%.*}" minor; minor="${v#*.}"; minor="${minor%%.*}"
      local f="" pkg
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        f+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        f+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
      done
      echo "-s -w$f" ;;
    helm) echo "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" ;;
    *) echo "-s -w" ;;
  esac
}

build_tool() {
  local name="$1" dir="$2" pkg="$3" t0 t1
  t0=$(date +%s)
  log "building $name ($pkg) ..."
  # -p 2: this machine has two cores shared with other work; nice keeps the build in the background.
  (cd "$HERE/$dir" && CGO_ENABLED=0 nice -n 10 go build -p 2 -trimpath \
      -ldflags "$(ldflags_for "$name")" -o "$BIN/.$name.tmp" "$pkg")
  mv -f "$BIN/.$name.tmp" "$BIN/$name"
  t1=$(date +%s)
  log "built $name in $((t1 - t0)) s"
  echo "$name $((t1 - t0))" >> "$DEST/build-times.txt"
}

copy_asset() {
  local rel="$1" dir="$2" mod="$3" sub="$4" src
  src="$(cd "$HERE/$dir" && go list -m -f '{{.Dir}}' "$mod")"
  if [[ -z "$src" || ! -d "$src/$sub" ]]; then
    echo "cannot find $sub in module $mod (go list said '$src')" >&2
    exit 1
  fi
  mkdir -p "$DEST/$rel.tmp"
  cp -r "$src/$sub/." "$DEST/$rel.tmp/"
  chmod -R u+w "$DEST/$rel.tmp"
  mv "$DEST/$rel.tmp" "$DEST/$rel"
  log "copied $mod/$sub"
}

install_prometheus() {
  debian_install controlplane prometheus
}

main() {
  check_pins
  local tools assets
  tools="$(missing_tools)"
  assets="$(missing_assets)"
  if [[ -z "$tools" && -z "$assets" ]] && ! need_prometheus; then
    log "all cached in $BIN"
    return 0
  fi

  export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false"
  command -v go >/dev/null || { echo "go is needed to build the control plane (Go >= 1.24)" >&2; exit 1; }
  mkdir -p "$BIN"
  # One build at a time per cache dir (CI and a developer's shell may both start one).
  exec 9>"$CACHE_ROOT/.build.lock"
  flock 9

  if need_prometheus; then install_prometheus; fi

  local t0 t name dir pkg a
  t0=$(date +%s)
  for t in "${TOOLS[@]}"; do
    IFS='|' read -r name dir pkg <<<"$t"
    [[ -x "$BIN/$name" ]] || build_tool "$name" "$dir" "$pkg"
  done
  for a in "${ASSETS[@]}"; do
    IFS='|' read -r name dir pkg sub <<<"$a"
    [[ -d "$DEST/$name" ]] || copy_asset "$name" "$dir" "$pkg" "$sub"
  done
  log "done in $(( $(date +%s) - t0 )) s; binaries in $BIN"
}

main "$@"
