#!/usr/bin/env bash
# Builds what a real node adds to the test control plane (tests/controlplane/build.sh): kubelet and
# kube-proxy from the k8s.io/kubernetes module the control plane is built from, CoreDNS from its Go
# module (tests/node/coredns), and the pause image from Kubernetes' own build/pause/linux/pause.c;
# and installs containerd, runc, the CNI plugins, iptables, conntrack, socat, buildah and gcc from
# Debian (apt-get, only what is missing). Versions: tests/controlplane/versions.env.
#
# Idempotent, with the control plane's cache convention: binaries and the pause image archive land
# in ~/.cache/rlkube/node/<versions-key>/, only what is missing is built, a warm run exits at once.
#
# Environment: RLKUBE_NODE_CACHE overrides ~/.cache/rlkube/node; RLKUBE_NODE_ANY_DEBIAN=1 accepts
# Debian packages whose upstream version differs from versions.env (another Debian release).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../../scripts/debian_install.sh
source "$HERE/../../scripts/debian_install.sh"
CONTROLPLANE="$(cd "$HERE/../controlplane" && pwd)"
set -a
# shellcheck source=../controlplane/versions.env
source "$CONTROLPLANE/versions.env"
set +a

KEY="k8s-${KUBERNETES_VERSION}_coredns-${COREDNS_VERSION}_pause-${PAUSE_VERSION}"
CACHE_ROOT="${RLKUBE_NODE_CACHE:-$HOME/.cache/rlkube/node}"
DEST="$CACHE_ROOT/$KEY"
BIN="$DEST/bin"
PAUSE_ARCHIVE="$DEST/pause.docker.tar"
PAUSE_IMAGE="localhost/rlkube/pause:$PAUSE_VERSION"

# name | module dir (relative to tests/) | main package
TOOLS=(
  "kubelet|controlplane/kubernetes|k8s.io/kubernetes/cmd/kubelet"
  "kube-proxy|controlplane/kubernetes|k8s.io/kubernetes/cmd/kube-proxy"
  "coredns|node/coredns|rlkube.local/node/coredns"
)

# Debian package | command it provides | versions.env pin (upstream version) or empty
PACKAGES=(
  "containerd|containerd|${CONTAINERD_VERSION}"
  "runc|runc|${RUNC_VERSION}"
  "containernetworking-plugins|/usr/lib/cni/bridge|${CNI_PLUGINS_VERSION}"
  "iptables|iptables|"
  "conntrack|conntrack|"
  "socat|socat|"
  "buildah|buildah|${BUILDAH_VERSION}"
  "gcc|gcc|"
  "libc6-dev|/usr/include/stdlib.h|"
)

log() { printf '[node] %s\n' "$*"; }

missing_packages() {
  local p pkg cmd
  for p in "${PACKAGES[@]}"; do
    IFS='|' read -r pkg cmd _ <<<"$p"
    # A command on PATH, or a file the package provides (stdlib.h is not executable: command -v misses it).
    if [[ "$cmd" == /* ]]; then [[ -e "$cmd" ]] || echo "$pkg"; else command -v "$cmd" >/dev/null 2>&1 || echo "$pkg"; fi
  done
}

upstream_version() {
  # 1:1.4.7-1+b2 -> 1.4.7; 1.6.20~ds1-1+deb12u3 -> 1.6.20
  local v; v="$(dpkg-query -W -f '${Version}' "$1" 2>/dev/null)" || return 0
  v="${v#*:}"; v="${v%-*}"; v="${v%%[~+]*}"
  echo "$v"
}

check_package_pins() {
  [[ "${RLKUBE_NODE_ANY_DEBIAN:-0}" == 1 ]] && return 0
  command -v dpkg-query >/dev/null || return 0
  local p pkg pin have bad=0
  for p in "${PACKAGES[@]}"; do
    IFS='|' read -r pkg _ pin <<<"$p"
    [[ -n "$pin" ]] || continue
    have="$(upstream_version "$pkg")"
    if [[ -n "$have" && "$have" != "$pin" ]]; then
      echo "Debian package $pkg is $have, tests/controlplane/versions.env pins $pin (Debian bookworm's);" \
           "set RLKUBE_NODE_ANY_DEBIAN=1 to use it anyway, or update the pin" >&2
      bad=1
    fi
  done
  return $bad
}

install_packages() {
  local t0; t0=$(date +%s)
  debian_install node "$@"
  echo "apt-get $(( $(date +%s) - t0 ))" >> "$DEST/build-times.txt"
}

ldflags_for() {
  local name="$1" v major minor f="" pkg
  case "$name" in
    kube*)
      # The version stamps of Kubernetes' hack/lib/version.sh, as tests/controlplane/build.sh sets them.
      v="${KUBERNETES_VERSION#v}"; major="${v%%.*}"; minor="${v#*.}"; minor="${minor%%.*}"
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        f+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        f+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
      done
      echo "-s -w$f" ;;
    coredns) echo "-s -w -X github.com/coredns/coredns/coremain.GitCommit=${COREDNS_VERSION}" ;;
    *) echo "-s -w" ;;
  esac
}

build_tool() {
  local name="$1" dir="$2" pkg="$3" t0
  t0=$(date +%s)
  log "building $name ($pkg) ..."
  # -p 2 and nice: two cores shared with other work, as for the control plane.
  (cd "$HERE/../$dir" && CGO_ENABLED=0 nice -n 10 go build -p 2 -trimpath \
      -ldflags "$(ldflags_for "$name")" -o "$BIN/.$name.tmp" "$pkg")
  mv -f "$BIN/.$name.tmp" "$BIN/$name"
  log "built $name in $(( $(date +%s) - t0 )) s"
  echo "$name $(( $(date +%s) - t0 ))" >> "$DEST/build-times.txt"
}

build_pause() {
  # pause.c is copied out of the module cache at build time (never into the repository), compiled
  # statically as Kubernetes' build/pause/Makefile does, and packed as an image the way its
  # Dockerfile does (the binary at /pause, USER 65535:65535), into an image archive that the node
  # imports into containerd when it starts (tests/node/node.py).
  local t0 src work c
  t0=$(date +%s)
  src="$(cd "$CONTROLPLANE/kubernetes" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
  [[ -f "$src" ]] || { echo "pause.c not found at $src (go mod download in tests/controlplane/kubernetes)" >&2; exit 1; }
  work="$(mktemp -d)"
  cp "$src" "$work/pause.c"
  gcc -Os -Wall -Werror -static -DVERSION="v${PAUSE_VERSION}-rlkube" -o "$work/pause" "$work/pause.c"
  strip "$work/pause" 2>/dev/null || true
  c="$(buildah from scratch)"
  buildah copy -q --chmod 0755 "$c" "$work/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 --os linux --arch amd64 "$c"
  buildah commit -q --rm "$c" "$PAUSE_IMAGE" >/dev/null
  rm -f "$PAUSE_ARCHIVE.tmp"
  buildah push -q "$PAUSE_IMAGE" "docker-archive:$PAUSE_ARCHIVE.tmp:$PAUSE_IMAGE"
  buildah rmi "$PAUSE_IMAGE" >/dev/null
  mv -f "$PAUSE_ARCHIVE.tmp" "$PAUSE_ARCHIVE"
  rm -rf "$work"
  log "built the pause image in $(( $(date +%s) - t0 )) s"
  echo "pause $(( $(date +%s) - t0 ))" >> "$DEST/build-times.txt"
}

main() {
  local packages t name dir pkg missing=0 t0
  packages="$(missing_packages)"
  for t in "${TOOLS[@]}"; do [[ -x "$BIN/${t%%|*}" ]] || missing=1; done
  [[ -f "$PAUSE_ARCHIVE" ]] || missing=1
  if [[ -z "$packages" && $missing == 0 ]]; then
    check_package_pins
    log "all cached in $DEST"
    return 0
  fi

  mkdir -p "$BIN"
  # One build at a time per cache dir (CI and a developer's shell may both start one).
  exec 9>"$CACHE_ROOT/.build.lock"
  flock 9
  t0=$(date +%s)
  packages="$(missing_packages)"
  if [[ -n "$packages" ]]; then
    command -v apt-get >/dev/null || { echo "missing: $packages, and there is no apt-get to install them" >&2; exit 1; }
    # shellcheck disable=SC2086
    install_packages $packages
  fi
  check_package_pins

  export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false"
  command -v go >/dev/null || { echo "go is needed to build the node (Go >= 1.24)" >&2; exit 1; }
  for t in "${TOOLS[@]}"; do
    IFS='|' read -r name dir pkg <<<"$t"
    [[ -x "$BIN/$name" ]] || build_tool "$name" "$dir" "$pkg"
  done
  [[ -f "$PAUSE_ARCHIVE" ]] || build_pause
  log "done in $(( $(date +%s) - t0 )) s; binaries in $BIN"
}

main "$@"
