"""kopf handlers: decorators and one call into the controller each.

Run with `rlkube operator` or `kopf run -m rlkube_operator.handlers`.

Every RLJob watch event (and every event of a RayJob labelled with its RLJob) reconciles that
RLJob from a fresh read; the controller queues the next reconcile itself (restart backoffs,
periodic resync). Only event handlers are used, so kopf keeps no state on the objects and adds no
finalizer: owner references cover deletion (see controller.Controller._reconcile_blocking).
"""

from __future__ import annotations

import logging
import os

import kopf
from rlkube_runtime.spec import API_GROUP, API_VERSION_NAME, PLURAL
from rlkube_runtime.spec.contract import ENV_METRICS_PORT

from . import metrics
from .controller import Controller
from .kube import RAY_GROUP, RAY_VERSION, RAYJOBS, Kube
from .reconcile import Event
from .render import LABEL_RLJOB
from .settings import OperatorSettings


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_) -> None:
    # Our own Events only (kopf.event below), not one per log line.
    settings.posting.level = logging.WARNING
    # Silent watch streams (kopf #585) are reconnected by kopf's watching.inactivity_timeout
    # (70 s by default); the controller's resync also re-reads every active RLJob.
    port = os.environ.get(ENV_METRICS_PORT)
    if port:  # `kopf run` path; `rlkube operator` starts the server before kopf
        metrics.serve(int(port))
    memo.controller = Controller(Kube.connect(), OperatorSettings.from_env(), emit=_post_event)
    logger.info("rlkube operator configured: %s", memo.controller.settings)


@kopf.on.cleanup()
def shutdown(memo: kopf.Memo, **_) -> None:
    controller = getattr(memo, "controller", None)
    if controller is not None:
        controller.stop()


@kopf.on.event(API_GROUP, API_VERSION_NAME, PLURAL)
async def rljob_event(type: str | None, name: str, namespace: str, memo: kopf.Memo, **_) -> None:
    if type == "DELETED":
        memo.controller.forget(namespace, name)
        return
    applied = await memo.controller.reconcile(namespace, name)
    if applied is not None and applied.plan.permanent_error and applied.status_patch:
        # Once, when the failure is first written; later reconciles of the failed job are quiet.
        raise kopf.PermanentError(f"RLJob {namespace}/{name} failed: {applied.plan.permanent_error}")


@kopf.on.event(RAY_GROUP, RAY_VERSION, RAYJOBS, labels={LABEL_RLJOB: kopf.PRESENT})
async def rayjob_event(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_) -> None:
    await memo.controller.reconcile(namespace, labels[LABEL_RLJOB])


def _post_event(body: dict, event: Event) -> None:
    kopf.event(body, type=event.type, reason=str(event.reason), message=event.message[:1024])
