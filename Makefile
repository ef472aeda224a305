# The two commands of the README. Both work on a fresh machine: they check what they cannot
# install themselves (scripts/check_prereqs.py names anything missing and how to get it), make the
# project's own virtual environment from the declared dependencies only (scripts/venv.py: reused
# while pyproject.toml is unchanged, made again from nothing when it changes) and then do their one job.
# Nothing is installed into the system interpreter, so nothing there can hide a missing declaration.
PYTHON ?= python3
VENV ?= .venv
VENV_BIN = $(CURDIR)/$(VENV)/bin
# Tests and the run use the venv's python, its console scripts (rlkube, ray, lint-imports) first on PATH.
IN_VENV = PATH="$(VENV_BIN):$$PATH" RLKUBE_VENV="$(CURDIR)/$(VENV)"
PYTEST = $(IN_VENV) $(VENV_BIN)/python -m pytest
HAVE_PYTHON = command -v $(PYTHON) >/dev/null || { echo "make: missing prerequisite: $(PYTHON) (Python 3.10+, 3.11+ for make test) is not on PATH: apt-get install python3 python3-venv, or make PYTHON=/path/to/python3" >&2; exit 1; }
# The unit tier: no control plane, no training runs; the inner loop (budget: 2 minutes).
FAST = -m "not slow and not controlplane"
# Three pytest-xdist workers on the 2 cores: the control-plane, node and chaos groups spend much of
# their time waiting on pods and restarts, and a third worker fills it (warm, a clean clone: 19 min 7 s
# on three, 21 min 41 s on two). Tests sharing a session fixture stay on one (tests/conftest.py).
TEST_WORKERS ?= 3

# The images the pods tier runs (tests/pods; images/build.sh builds them from the repository's
# Dockerfiles on a local Debian base and loads them into the real node's containerd).
TEST_IMAGES ?= operator rollout

.PHONY: run test test-fast test-suite test-prereqs venv venv-dev controlplane node images images-built cluster cluster-down check-run check-test check-cluster

## run: train the embedded default RLJob locally and watch the reward climb
run: venv
	$(IN_VENV) rlkube run manifests/examples/local-tiny.yaml

## test: the whole test suite (unit, slow, control-plane integration), exactly what CI runs; its total time at the end
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory test-suite; rc=$$?; took=$$(( $$(date +%s) - start )); \
	echo "make test: exit $$rc after $$((took / 60)) min $$((took % 60)) s (set-up and suite)"; exit $$rc

test-suite:
	@$(MAKE) --no-print-directory -j4 test-prereqs
	$(PYTEST) -ra --durations=30 -n $(TEST_WORKERS) --dist loadgroup

# What the suite needs built, side by side: on a fresh machine the Go builds (CPU) overlap the
# venv's and the images' downloads and installs (network, disk); each is a no-op once cached.
# One after another on a fresh 2-core machine they took 29 min (venv 3.5, control plane 11.4,
# node 1.8, images 12.5).
test-prereqs: venv-dev controlplane node images

## test-fast: the unit tests only (no control plane running, no training runs; helm and promtool from the build)
test-fast:
	@$(MAKE) --no-print-directory -j2 venv-dev controlplane
	$(PYTEST) -q $(FAST) -n $(TEST_WORKERS) --dist loadgroup

check-run:
	@$(HAVE_PYTHON)
	@$(PYTHON) scripts/check_prereqs.py run

check-test:
	@$(HAVE_PYTHON)
	@$(PYTHON) scripts/check_prereqs.py test

check-cluster:
	@$(HAVE_PYTHON)
	@$(PYTHON) scripts/check_prereqs.py cluster

venv: check-run
	@RLKUBE_VENV="$(CURDIR)/$(VENV)" $(PYTHON) scripts/venv.py run >/dev/null

venv-dev: check-test
	@RLKUBE_VENV="$(CURDIR)/$(VENV)" $(PYTHON) scripts/venv.py dev >/dev/null

controlplane: check-test
	bash tests/controlplane/build.sh

# The real node's pieces (kubelet, kube-proxy, CoreDNS, the pause image; containerd and the rest
# from Debian), cached like the control plane.
# After the control plane: kubelet and kube-proxy compile from the same Kubernetes module, whose
# packages two Go builds at once would each compile (the node's build took 14 min beside the
# control plane's instead of 2 after it).
node: check-test controlplane
	bash tests/node/build.sh

# Built first without the node (buildah needs none), so the build overlaps the node's; then loaded
# into the node's containerd (the second build.sh finds every layer cached: seconds).
images: node images-built
	bash images/build.sh $(TEST_IMAGES)

images-built: check-test
	RLKUBE_IMAGES_NO_LOAD=1 bash images/build.sh $(TEST_IMAGES)

## cluster: a real one-node cluster on this machine (root), for trying rlkube without a cluster at hand; prints its kubeconfig
cluster: check-cluster venv
	bash tests/controlplane/build.sh
	bash tests/node/build.sh
	bash images/build.sh operator rollout
	$(IN_VENV) $(VENV_BIN)/python tests/node/cluster.py up

## cluster-down: stop that cluster and remove what it left on the machine (containers, network, mounts)
cluster-down:
	@$(HAVE_PYTHON)
	@$(PYTHON) tests/node/cluster.py down
