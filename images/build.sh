#!/usr/bin/env bash
# Builds rlkube's images from this repository's own Dockerfiles without a Docker daemon or a
# registry, and loads them into the real node's containerd (tests/node), where pods use them.
#
#   images/build.sh                    # the operator image
#   images/build.sh operator trainer rollout
#
# Each Dockerfile is built as it is, by buildah (Debian's, daemonless) with `--layers`, with only
# BASE pointed at a local Debian bookworm Python image that mmdebstrap makes from Debian's packages
# (python3, python3-venv, ca-certificates, passwd; a venv at /opt/venv first on PATH, since Debian's
# python3 refuses `pip install` outside one and has no `python`). The production bases (CUDA) stay
# the Dockerfiles' defaults. Images are named as the chart and the operator name them
# (rlkube/operator:<version>, ...; containerd resolves them to docker.io/rlkube/...).
#
# Cached: the base is made once per recipe; buildah reuses every layer whose inputs are unchanged
# (the dependency layers depend on pyproject.toml's dependencies only); an image containerd already
# holds (same buildah image id) is not loaded again; so an unchanged rebuild takes seconds.
#
# Environment: RLKUBE_IMAGES_NO_LOAD=1 builds without loading; RLKUBE_IMAGE_TAG overrides the tag
# (default: pyproject.toml's version).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=../scripts/debian_install.sh
source "$REPO/scripts/debian_install.sh"
cd "$REPO"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)"
TAG="${RLKUBE_IMAGE_TAG:-$VERSION}"
TIMES="$HOME/.cache/rlkube/images/build-times.txt"

# image | Dockerfile
declare -A DOCKERFILE=(
  [operator]=images/operator.Dockerfile
  [trainer]=Dockerfile.trainer
  [rollout]=Dockerfile.rollout
)

# The base's recipe; its hash names the base image, so changing it makes a new one.
BASE_PACKAGES="python3,python3-venv,ca-certificates,passwd"
BASE_SUITE="bookworm"

log() { printf '[images] %s\n' "$*"; }

need_packages() {
  local missing=()
  command -v buildah >/dev/null || missing+=(buildah)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  debian_install images "${missing[@]}"
}

# CA certificates this machine trusts beyond Debian's (a TLS-inspecting proxy's): pip inside a
# build step trusts only the image's store, so the base gets them too, and only when they exist.
extra_cas() {
  find /usr/local/share/ca-certificates -type f -name '*.crt' 2>/dev/null | sort
}

base_image() {
  local recipe
  recipe="$BASE_SUITE $BASE_PACKAGES venv=/opt/venv $(extra_cas | xargs -r cat | sha256sum | cut -c1-16)"
  echo "localhost/rlkube/base:${BASE_SUITE}-$(echo "$recipe" | sha256sum | cut -c1-12)"
}

build_base() {
  local image="$1" work c t0 ca
  t0=$(date +%s)
  log "making the base $image with mmdebstrap ..."
  work="$(mktemp -d)"
  mkdir -p "$work/ca"
  while read -r ca; do [[ -n "$ca" ]] && cp "$ca" "$work/ca/"; done < <(extra_cas)
  # --variant=minbase: Debian's essential packages and apt, plus the recipe's; the hooks add the
  # machine's extra CAs and the venv at /opt/venv (with pip from ensurepip).
  mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" \
    --customize-hook="cp $work/ca/*.crt \"\$1/usr/local/share/ca-certificates/\" 2>/dev/null; chroot \"\$1\" update-ca-certificates >/dev/null" \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
    "$BASE_SUITE" "$work/base.tar"
  c="$(buildah from scratch)"
  buildah add --quiet "$c" "$work/base.tar" / >/dev/null
  buildah config --os linux --arch amd64 \
    --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env VIRTUAL_ENV=/opt/venv --env LANG=C.UTF-8 --cmd python3 "$c"
  buildah commit --quiet --rm "$c" "$image" >/dev/null
  rm -rf "$work"
  log "made the base in $(( $(date +%s) - t0 )) s"
  echo "$(date -u +%FT%TZ) base $(( $(date +%s) - t0 ))" >> "$TIMES"
}

build_image() {
  local name="$1" base="$2" t0
  t0=$(date +%s)
  log "building rlkube/$name:$TAG from ${DOCKERFILE[$name]} ..."
  # chroot isolation: no daemon, no user namespaces or cgroup setup needed; --layers caches each step.
  nice -n 10 buildah bud --quiet --layers --isolation chroot --build-arg "BASE=$base" \
    -f "${DOCKERFILE[$name]}" -t "rlkube/$name:$TAG" . >/dev/null
  log "built rlkube/$name:$TAG in $(( $(date +%s) - t0 )) s ($(image_size "rlkube/$name:$TAG"))"
  echo "$(date -u +%FT%TZ) $name build $(( $(date +%s) - t0 ))" >> "$TIMES"
}

image_size() {
  buildah images --format '{{.Size}}' "$1" 2>/dev/null | head -1
}

main() {
  local images=("$@") name base t0
  [[ ${#images[@]} -gt 0 ]] || images=(operator)
  for name in "${images[@]}"; do
    [[ -n "${DOCKERFILE[$name]:-}" ]] || { echo "unknown image '$name'; known: ${!DOCKERFILE[*]}" >&2; exit 2; }
  done
  [[ $EUID -eq 0 ]] || { echo "images/build.sh runs buildah as root (chroot isolation); run it as root" >&2; exit 1; }
  need_packages
  mkdir -p "$(dirname "$TIMES")"
  # One build at a time on this machine (buildah's storage is shared).
  exec 9>"$(dirname "$TIMES")/.build.lock"
  flock 9

  base="$(base_image)"
  buildah inspect --type image "$base" >/dev/null 2>&1 || build_base "$base"
  for name in "${images[@]}"; do
    build_image "$name" "$base"
  done
  # Layers no tag reaches any more (an earlier build's code layers); the cached ones stay.
  buildah rmi --prune >/dev/null 2>&1 || true

  if [[ "${RLKUBE_IMAGES_NO_LOAD:-0}" == 1 ]]; then
    return 0
  fi
  t0=$(date +%s)
  local refs=()
  for name in "${images[@]}"; do refs+=("rlkube/$name:$TAG"); done
  python3 "$REPO/tests/node/cluster.py" load "${refs[@]}"
  echo "$(date -u +%FT%TZ) load ${images[*]} $(( $(date +%s) - t0 ))" >> "$TIMES"
}

main "$@"
