# shellcheck shell=bash
# One way to install Debian packages for the build scripts (tests/controlplane, tests/node,
# images), sourced by each. `make test` runs those builds in parallel, and apt-get refuses to run
# while another holds dpkg's lock, so every install here waits its turn on one lock file first.
#
#   source scripts/debian_install.sh
#   debian_install <log-prefix> pkg...

debian_install() {
  local who="$1" sudo="" t0
  shift
  [[ $# -gt 0 ]] || return 0
  command -v apt-get >/dev/null || { echo "missing $*, and there is no apt-get to install them (Debian/Ubuntu packages)" >&2; exit 1; }
  if [[ $EUID -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "installing $* needs root: apt-get install -y $*" >&2; exit 1; }
    sudo="sudo"
  fi
  t0=$(date +%s)
  printf '[%s] installing %s from Debian ...\n' "$who" "$*"
  (
    export DEBIAN_FRONTEND=noninteractive
    # Another process's apt (not one of ours) is waited for too, up to ten minutes.
    local apt=(apt-get -o DPkg::Lock::Timeout=600 -y -qq --no-install-recommends)
    flock 8
    if ! $sudo "${apt[@]}" install "$@" >/dev/null 2>&1; then
      $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
      $sudo "${apt[@]}" install "$@" >/dev/null
    fi
  ) 8>"${TMPDIR:-/tmp}/rlkube-apt.lock"
  printf '[%s] installed %s in %s s\n' "$who" "$*" "$(( $(date +%s) - t0 ))"
}
