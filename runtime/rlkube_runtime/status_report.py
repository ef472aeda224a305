"""The runtime's side of RLJob status: progress, the last checkpoint and the last metrics, written
to the RLJob's status subresource while the job runs on Kubernetes.

The operator renders each attempt's pods with RLKUBE_RLJOB_NAME and RLKUBE_RLJOB_NAMESPACE, and a
ServiceAccount whose Role allows get/patch on `rljobs/status` of that one RLJob and nothing else.
The operator owns phase and conditions; the runtime writes only `progress`, `lastCheckpoint`,
`metrics`, `restarts.engine`, when it refuses the spec at start `invalidSpec` (the message and
the attempt, read from RLKUBE_ATTEMPT), and when SIGTERM stops an attempt after its checkpoint
`lastPreemption`, as JSON merge patches, so neither side overwrites the other's fields. The operator
fails a job whose current attempt reported `invalidSpec` for good, and resumes one that reported
`lastPreemption` without counting a failure.

Reporting is best effort: a failed patch is logged and training goes on.

    reporter = RLJobStatusReporter.from_env()   # None outside a cluster
    if reporter:
        reporter.report(rollout=5, num_rollout=100, metrics={"reward_mean": 0.4})
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from .spec.base import API_GROUP, API_VERSION_NAME, PLURAL
from .spec.contract import ENV_ATTEMPT, ENV_RLJOB_NAME, ENV_RLJOB_NAMESPACE

log = logging.getLogger(__name__)

ENV_NAME = ENV_RLJOB_NAME
ENV_NAMESPACE = ENV_RLJOB_NAMESPACE
TIMEOUT_SECONDS = 10
# status.metrics keys the CRD declares (others would be pruned by the API server).
METRIC_KEYS = ("rewardMean", "kl", "stepSeconds")


class RLJobStatusReporter:
    def __init__(self, name: str, namespace: str, api_client: Any, attempt: int | None = None):
        self.name = name
        self.namespace = namespace
        self.attempt = attempt  # which attempt this runtime is (RLKUBE_ATTEMPT); None when unknown
        from kubernetes import client

        self._api = client.CustomObjectsApi(api_client)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, kubeconfig: str | None = None) -> RLJobStatusReporter | None:
        """A reporter for the RLJob named by RLKUBE_RLJOB_NAME / RLKUBE_RLJOB_NAMESPACE, using the
        pod's service-account credentials (or `kubeconfig`, or KUBECONFIG, outside a pod).

        None when the variables are unset (a local `rlkube run`) or no credentials are found.
        """
        env = os.environ if env is None else env
        name, namespace = env.get(ENV_NAME), env.get(ENV_NAMESPACE)
        if not name or not namespace:
            return None
        try:
            from kubernetes import client, config
        except ImportError:
            log.warning("%s is set but the kubernetes package is missing; RLJob status will not be reported", ENV_NAME)
            return None
        configuration = client.Configuration()
        try:
            if kubeconfig is None:
                try:
                    config.load_incluster_config(client_configuration=configuration)
                except config.ConfigException:
                    config.load_kube_config(config_file=env.get("KUBECONFIG"), client_configuration=configuration)
            else:
                config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        except Exception as exc:  # noqa: BLE001 - no credentials is a reason to skip, not to stop
            log.warning("no Kubernetes credentials (%s); RLJob %s/%s status will not be reported", exc, namespace, name)
            return None
        return cls(name, namespace, client.ApiClient(configuration), attempt=attempt_from_env(env))

    def report(
        self,
        rollout: int,
        num_rollout: int,
        last_checkpoint: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        engine_restarts: int | None = None,
    ) -> bool:
        """Patch progress (and the last checkpoint, metrics and engine restarts when given); True
        if it was written.

        last_checkpoint: {"rollout": int, "path": str, "time": datetime or RFC 3339 string}.
        metrics: numbers keyed rewardMean/reward_mean, kl, stepSeconds/step_seconds; others and
        non-finite values are left out.
        engine_restarts: the job's total (`engine_restarts_so_far()` at start, plus this attempt's).
        """
        return self.patch(build_status_patch(rollout, num_rollout, last_checkpoint, metrics, engine_restarts))

    def report_invalid_spec(self, message: str) -> bool:
        """Tell the operator this attempt refused the spec (`message` names the field): it fails
        the job with reason InvalidSpec rather than restarting into the same refusal."""
        return self.patch(build_invalid_spec_patch(message, self.attempt))

    def report_preempted(self, attempt: int, rollout: int | None, when: datetime | None = None) -> bool:
        """Tell the operator this attempt stopped on SIGTERM with every trained rollout saved (in
        the checkpoint of `rollout`, None when nothing was trained): it resumes the job instead
        of counting a failure. Written before the process exits, so it lands before the Ray job
        is reported over."""
        return self.patch(build_preemption_patch(attempt, rollout, when or datetime.now(timezone.utc)))

    def engine_restarts_so_far(self) -> int:
        """status.restarts.engine as earlier attempts left it (0 when unset or unreadable): each
        attempt adds its own restarts to it, so the count covers the whole job."""
        try:
            obj = self._api.get_namespaced_custom_object_status(
                API_GROUP, API_VERSION_NAME, self.namespace, PLURAL, self.name, _request_timeout=TIMEOUT_SECONDS
            )
        except Exception as exc:  # noqa: BLE001 - reporting must never stop training
            log.warning("could not read status of RLJob %s/%s: %s", self.namespace, self.name, getattr(exc, "reason", None) or exc)
            return 0
        return int(((obj.get("status") or {}).get("restarts") or {}).get("engine") or 0)

    def patch(self, status: dict[str, Any]) -> bool:
        try:
            self._api.patch_namespaced_custom_object_status(
                API_GROUP, API_VERSION_NAME, self.namespace, PLURAL, self.name, {"status": status},
                _content_type="application/merge-patch+json", _request_timeout=TIMEOUT_SECONDS,
            )
        except Exception as exc:  # noqa: BLE001 - reporting must never stop training
            reason = getattr(exc, "reason", None) or exc
            log.warning("could not report status of RLJob %s/%s: %s", self.namespace, self.name, reason)
            return False
        return True


def build_status_patch(
    rollout: int,
    num_rollout: int,
    last_checkpoint: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    engine_restarts: int | None = None,
) -> dict[str, Any]:
    """The status fields the runtime owns, in the CRD's camelCase shape (`restarts.engine`; the
    operator owns `restarts.job`, and a merge patch leaves it alone)."""
    status: dict[str, Any] = {"progress": {"rollout": int(rollout), "numRollout": int(num_rollout)}}
    if engine_restarts is not None:
        status["restarts"] = {"engine": int(engine_restarts)}
    if last_checkpoint:
        ckpt: dict[str, Any] = {}
        if last_checkpoint.get("rollout") is not None:
            ckpt["rollout"] = int(last_checkpoint["rollout"])
        if last_checkpoint.get("path"):
            ckpt["path"] = str(last_checkpoint["path"])
        when = last_checkpoint.get("time")
        if isinstance(when, datetime):
            when = _rfc3339(when)
        if when:
            ckpt["time"] = str(when)
        status["lastCheckpoint"] = ckpt
    if metrics:
        values = {}
        for key, value in metrics.items():
            camel = _camel(key)
            if camel in METRIC_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                values[camel] = float(value)
        if values:
            status["metrics"] = values
    return status


def build_invalid_spec_patch(message: str, attempt: int | None) -> dict[str, Any]:
    """The `invalidSpec` status the runtime writes when it refuses the spec at an attempt's start."""
    refusal: dict[str, Any] = {"message": str(message)}
    if attempt is not None:
        refusal["attempt"] = int(attempt)
    return {"invalidSpec": refusal}


def build_preemption_patch(attempt: int, rollout: int | None, when: datetime) -> dict[str, Any]:
    """status.lastPreemption, the runtime's note that attempt `attempt` ended by a preemption."""
    record: dict[str, Any] = {"attempt": int(attempt), "time": _rfc3339(when)}
    # Explicit null: a merge patch must clear the rollout an earlier preemption left.
    record["rollout"] = int(rollout) if rollout is not None else None
    return {"lastPreemption": record}


def attempt_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The attempt number the operator gave this pod (RLKUBE_ATTEMPT); None outside a cluster."""
    value = (os.environ if env is None else env).get(ENV_ATTEMPT)
    try:
        return int(value) if value is not None else None
    except ValueError:
        log.warning("%s=%r is not an attempt number; a preemption will not be reported", ENV_ATTEMPT, value)
        return None


def _rfc3339(when: datetime) -> str:
    return when.astimezone(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def _camel(key: str) -> str:
    return re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
