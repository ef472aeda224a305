# The operator image: kopf + the kubernetes client + the RLJob spec; no torch, no Ray.
# Build: docker build -f images/operator.Dockerfile -t rlkube/operator:0.1.0 .
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /opt/rlkube
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY operator ./operator
RUN pip install ".[operator]"
USER 65532:65532
ENTRYPOINT ["rlkube", "operator"]
