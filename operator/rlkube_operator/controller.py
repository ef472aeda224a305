"""One reconcile of one RLJob: read (kube) -> decide (reconcile) -> act (kube) -> events, metrics.

Reconciles of the same RLJob never overlap (a lock per RLJob), and each starts from a fresh read
of the API server, so two watch events arriving together (the RLJob's and its RayJob's) cannot
act on stale views. After each reconcile the RLJob is queued again when the plan says so (a
restart backoff ending, or the periodic resync of active jobs); a restarted operator rebuilds all
of this from the initial listing of RLJobs.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from . import metrics, render
from .kube import InvalidObject, Kube, api_error_status, api_error_text, api_unreachable, namespace_terminating
from .reconcile import Event, Observed, Plan, current_attempt, reconcile, refused_by_api_server
from .settings import OperatorSettings
from .status import status_changes

log = logging.getLogger(__name__)

Key = tuple[str, str]
EmitFn = Callable[[dict[str, Any], Event], None]

ERROR_RETRY_SECONDS = 5.0
_CHILD_KINDS = ("ConfigMap", "ServiceAccount", "Role", "RoleBinding")


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class Applied:
    """One reconcile carried out: the plan, and the merge patch written to the RLJob's status
    ({} when the status already was as planned)."""

    plan: Plan
    status_patch: dict[str, Any]


class Controller:
    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        emit: EmitFn,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.emit = emit
        self.clock = clock
        self.phases = metrics.PhaseTracker()
        self._locks: dict[Key, asyncio.Lock] = {}
        self._timers: dict[Key, asyncio.TimerHandle] = {}

    async def reconcile(self, namespace: str, name: str) -> Applied | None:
        """Reconcile one RLJob now; None when it no longer exists (or is being deleted), or when
        the reconcile failed (logged, and retried after ERROR_RETRY_SECONDS)."""
        key = (namespace, name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            started = time.monotonic()
            try:
                result = await asyncio.to_thread(self._reconcile_blocking, namespace, name)
            except Exception as exc:
                metrics.RECONCILES.labels("error").inc()
                status = api_error_status(exc)
                metrics.RECONCILE_ERRORS.labels("api" if status is not None else "internal").inc()
                if namespace_terminating(exc):
                    # The namespace and everything in it is going; nothing left to reconcile.
                    log.info("namespace %s is being deleted; RLJob %s is left to it", namespace, name)
                    self.forget(namespace, name)
                    return None
                if status in (404, 409):
                    # Something changed underneath (an object deleted or created meanwhile): the
                    # next reconcile starts from a fresh read.
                    log.info("RLJob %s/%s changed during reconcile (%s); again in %gs",
                             namespace, name, api_error_text(exc), ERROR_RETRY_SECONDS)
                elif status is not None:
                    log.warning("reconcile of RLJob %s/%s failed; retrying in %gs: %s",
                                namespace, name, ERROR_RETRY_SECONDS, api_error_text(exc))
                elif (unreachable := api_unreachable(exc)) is not None:
                    # One line per retry, not a traceback: the API server restarting is expected.
                    log.warning("reconcile of RLJob %s/%s failed: the API server did not answer (%s); retrying in %gs",
                                namespace, name, unreachable, ERROR_RETRY_SECONDS)
                else:
                    log.exception("reconcile of RLJob %s/%s failed; retrying in %gs", namespace, name,
                                  ERROR_RETRY_SECONDS)
                self._schedule(key, ERROR_RETRY_SECONDS)
                return None
            finally:
                metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        metrics.RECONCILES.labels("ok").inc()
        if result is None:
            self.forget(namespace, name)
            return None
        body, applied = result
        plan = applied.plan
        if plan.permanent_error:
            metrics.RECONCILE_ERRORS.labels("spec").inc()
        self.phases.set(key, None if plan.delete_rljob else plan.status.get("phase"))
        for event in plan.events:
            self.emit(body, event)
        self._schedule(key, None if plan.delete_rljob else plan.requeue_after)
        return applied

    def forget(self, namespace: str, name: str) -> None:
        """The RLJob is gone: drop its timer and its phase from the metrics."""
        key = (namespace, name)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self.phases.set(key, None)
        lock = self._locks.get(key)
        if lock is not None and not lock.locked():
            self._locks.pop(key, None)

    def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    # --- internals -------------------------------------------------------------------------

    def _schedule(self, key: Key, delay: float | None) -> None:
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        if delay is None:
            return
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(max(delay, 0.05), lambda: loop.create_task(self._requeued(key)))

    async def _requeued(self, key: Key) -> None:
        self._timers.pop(key, None)
        await self.reconcile(*key)

    def _reconcile_blocking(self, namespace: str, name: str) -> tuple[dict[str, Any], Applied] | None:
        kube = self.kube
        body = kube.get_rljob(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            # Deletion needs nothing from the operator: every child has an owner reference to the
            # RLJob, and the garbage collector removes them. Hence no finalizer (and no timers or
            # daemons, for which kopf would add one): an RLJob deletes even while the operator is down.
            return None
        uid = body["metadata"]["uid"]
        selector = f"{render.LABEL_RLJOB}={name}"
        rayjobs = [rj for rj in kube.list_rayjobs(namespace, selector) if _owned_by(rj, uid)]
        children: dict[str, dict[str, Any] | None] = {}
        conflicts = []
        for kind in _CHILD_KINDS:
            child_name = render.configmap_name(name) if kind == "ConfigMap" else render.runtime_account_name(name)
            obj = kube.get(kind, namespace, child_name)
            if obj is not None and not _owned_by(obj, uid):
                conflicts.append(f"{kind} {child_name}")
                obj = None
            children[kind] = obj
        n = current_attempt(body.get("status") or {}, rayjobs)
        pods = kube.list_pods(namespace, f"{selector},{render.LABEL_ATTEMPT}={n}")
        observed = Observed(
            rljob=body,
            rayjobs=rayjobs,
            configmap=children["ConfigMap"],
            service_account=children["ServiceAccount"] is not None,
            role=children["Role"] is not None,
            role_binding=children["RoleBinding"] is not None,
            pods=pods,
            now=self.clock(),
            conflicts=tuple(conflicts),
            new_api_key=secrets.token_urlsafe(32),
        )
        try:
            return body, self._apply(body, reconcile(observed, self.settings))
        except InvalidObject as exc:
            # Not a transient error: the same spec renders the same object, refused again. The job
            # fails now, with the API server's own words (no retry).
            log.warning("RLJob %s/%s: the API server refused %s %s as invalid: %s", namespace, name, exc.kind,
                        exc.name, exc.message)
            return body, self._apply(body, refused_by_api_server(observed, exc.kind, exc.name, exc.message))

    def _apply(self, body: dict[str, Any], plan: Plan) -> Applied:
        kube = self.kube
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        for obj in plan.create:
            if kube.create(obj):
                metrics.OBJECTS_CREATED.labels(obj["kind"]).inc()
                log.info("created %s %s/%s", obj["kind"], namespace, obj["metadata"]["name"])
                if obj["kind"] == render.RAYJOB_KIND and plan.restart is not None:
                    metrics.RESTARTS.labels(plan.restart).inc()
        if plan.update_configmap is not None:
            kube.update_configmap_data(namespace, plan.update_configmap["metadata"]["name"], plan.update_configmap["data"])
        for rayjob, patch in plan.patch_rayjobs:
            kube.patch_rayjob(namespace, rayjob, patch)
        for rayjob in plan.delete_rayjobs:
            kube.delete_rayjob(namespace, rayjob)
            log.info("deleted RayJob %s/%s", namespace, rayjob)
        changes = status_changes(body.get("status") or {}, plan.status)
        if changes:
            kube.patch_rljob_status(namespace, name, changes)
        if plan.delete_rljob:
            kube.delete_rljob(namespace, name)
        return Applied(plan, changes)


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)
