"""`rlkube operator`: kopf with rlkube's handlers, a liveness endpoint and a Prometheus server."""

from __future__ import annotations

import logging
import os

LIVENESS_DEFAULT = "http://0.0.0.0:8081/healthz"


def run_operator(namespace: str | None = None, standalone: bool = False, metrics_port: int | None = 8080) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code.

    namespace: watch only this namespace (default: the whole cluster).
    standalone: no peering with other operator instances (one active operator is still required).
    metrics_port: serve /metrics here (0 or None: no metrics server).
    The liveness endpoint is RLKUBE_LIVENESS_ENDPOINT (default LIVENESS_DEFAULT; empty: none).
    """
    import kopf

    from . import handlers, metrics  # noqa: F401 - importing handlers registers them with kopf

    debug = os.environ.get("RLKUBE_LOG_LEVEL", "").upper() == "DEBUG"
    kopf.configure(verbose=debug)
    logging.getLogger("rlkube_operator").setLevel(logging.DEBUG if debug else logging.INFO)
    if not debug:
        # kopf logs every handler success at INFO; its warnings and errors still show.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per liveness probe
    if metrics_port:
        metrics.serve(metrics_port)
    liveness = os.environ.get("RLKUBE_LIVENESS_ENDPOINT", LIVENESS_DEFAULT) or None
    kopf.run(
        standalone=standalone,
        clusterwide=namespace is None,
        namespaces=[namespace] if namespace else (),
        liveness_endpoint=liveness,
    )
    return 0
