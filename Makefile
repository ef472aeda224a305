# The two commands of the README. Both work on a fresh machine: they install what they need
# (pip reuses what is already installed and keeps its cache) and then do their one job.
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install --disable-pip-version-check -q

.PHONY: run test install install-dev controlplane

## run: train the embedded default RLJob locally and watch the reward climb
run: install
	rlkube run manifests/examples/local-tiny.yaml

## test: the whole test suite (unit, slow, control-plane integration), exactly what CI runs
test: install-dev controlplane
	$(PYTHON) -m pytest -ra

install:
	$(PIP_INSTALL) -e '.[runtime]'

install-dev:
	$(PIP_INSTALL) -e '.[dev]'
	# SGLang's wheel for its argument parser only (the conformance tests): its declared
	# dependencies would pull a CUDA torch build, the few its import needs are in the dev extra.
	$(PIP_INSTALL) --no-deps sglang==0.5.8

controlplane:
	bash tests/controlplane/build.sh
