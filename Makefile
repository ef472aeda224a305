# The two commands of the README. Both work on a fresh machine: they check what they cannot
# install themselves (scripts/check_prereqs.py names anything missing and how to get it), install
# what they need (pip reuses what is already installed and keeps its cache) and then do their one job.
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install --disable-pip-version-check -q
HAVE_PYTHON = command -v $(PYTHON) >/dev/null || { echo "make: missing prerequisite: $(PYTHON) (Python 3.10+, 3.11+ for make test) is not on PATH: apt-get install python3 python3-pip, or make PYTHON=/path/to/python3" >&2; exit 1; }

.PHONY: run test install install-dev controlplane check-run check-test

## run: train the embedded default RLJob locally and watch the reward climb
run: install
	rlkube run manifests/examples/local-tiny.yaml

## test: the whole test suite (unit, slow, control-plane integration), exactly what CI runs
test: install-dev controlplane
	$(PYTHON) -m pytest -ra

check-run:
	@$(HAVE_PYTHON)
	@$(PYTHON) scripts/check_prereqs.py run

check-test:
	@$(HAVE_PYTHON)
	@$(PYTHON) scripts/check_prereqs.py test

install: check-run
	$(PIP_INSTALL) -e '.[runtime]'

install-dev: check-test
	$(PIP_INSTALL) -e '.[dev]'
	# SGLang's wheel for its argument parser only (the conformance tests): its declared
	# dependencies would pull a CUDA torch build, the few its import needs are in the dev extra.
	$(PIP_INSTALL) --no-deps sglang==0.5.8

controlplane:
	bash tests/controlplane/build.sh
