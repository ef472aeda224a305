# The operator image: kopf + the kubernetes client + the RLJob spec; no torch, no Ray.
# Build: docker build -f images/operator.Dockerfile -t rlkube/operator:0.1.0 .
# BASE: a Debian or Ubuntu image whose `python3` and `pip` are on PATH (images/build.sh passes a
# local Debian one, built without a registry).
ARG BASE=python:3.11-slim

# pyproject.toml without the [tool.*] tables that do not affect the install (pytest, import-linter):
# the dependency layer below depends on this file only, so editing those keeps it cached.
FROM ${BASE} AS deps
WORKDIR /deps
COPY pyproject.toml /src/
RUN python3 -c "import re; parts = re.split(r'(?m)^(?=\[)', open('/src/pyproject.toml').read()); open('pyproject.toml', 'w').write(''.join(p for p in parts if not p.startswith('[tool.') or p.startswith('[tool.setuptools')))"

FROM ${BASE}
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# A fixed non-root user with a passwd entry (kopf's getpass.getuser() needs one), so pods can meet the
# restricted Pod Security Standard (runAsNonRoot).
RUN groupadd --gid 65532 rlkube && useradd --uid 65532 --gid 65532 --create-home --shell /bin/sh rlkube
WORKDIR /opt/rlkube
# Dependencies first, resolved from pyproject.toml with an empty package standing in for the code:
# a code change rebuilds only the small layers after it.
COPY --from=deps /deps/pyproject.toml ./
RUN mkdir -p runtime/rlkube_runtime operator/rlkube_operator \
 && touch README.md runtime/rlkube_runtime/__init__.py operator/rlkube_operator/__init__.py \
 && pip install ".[operator]" && rm -rf build runtime/*.egg-info
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
RUN pip install --no-deps --force-reinstall . && rm -rf build runtime/*.egg-info
USER 65532:65532
ENTRYPOINT ["rlkube", "operator"]
