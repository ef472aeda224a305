"""The operator's only door to the Kubernetes API (an import-linter contract keeps it so).

One `Kube` is built at operator start and shared by every reconcile; it wraps the official
`kubernetes` client. Reads return plain dicts in the API's own camelCase shape, the same shape
kopf hands to handlers, so the pure layers see one format. Writes are idempotent: creating what
exists or deleting what is gone is not an error.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from rlkube_runtime.spec import API_GROUP, API_VERSION_NAME, PLURAL

log = logging.getLogger(__name__)

RAY_GROUP, RAY_VERSION, RAYJOBS = "ray.io", "v1", "rayjobs"
TIMEOUT = 30  # seconds per API call
MERGE_PATCH = "application/merge-patch+json"


class InvalidObject(Exception):
    """The API server refused to create an object as invalid (HTTP 422): the spec it was rendered
    from cannot become it, and another try would be refused the same way."""

    def __init__(self, kind: str, name: str, message: str):
        self.kind, self.name, self.message = kind, name, message
        super().__init__(f"{kind} {name}: {message}")

    def __reduce__(self):
        return type(self), (self.kind, self.name, self.message)


class Kube:
    def __init__(self, api_client: client.ApiClient):
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    @classmethod
    def connect(cls, kubeconfig: str | None = None) -> Kube:
        """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
        configuration = client.Configuration()
        if kubeconfig is None:
            try:
                config.load_incluster_config(client_configuration=configuration)
                return cls(client.ApiClient(configuration))
            except config.ConfigException:
                pass
        # KUBECONFIG read now, not when the kubernetes package was imported (its default is).
        path = kubeconfig or os.environ.get("KUBECONFIG") or None
        config.load_kube_config(config_file=path, client_configuration=configuration)
        return cls(client.ApiClient(configuration))

    def _plain(self, obj: Any) -> dict[str, Any]:
        return self.api.sanitize_for_serialization(obj)

    # --- RLJobs ----------------------------------------------------------------------------

    def get_rljob(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _none_if_missing(
            lambda: self.custom.get_namespaced_custom_object(
                API_GROUP, API_VERSION_NAME, namespace, PLURAL, name, _request_timeout=TIMEOUT
            )
        )

    def patch_rljob_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """JSON merge patch of the status subresource (keys the patch leaves out are kept)."""
        self.custom.patch_namespaced_custom_object_status(
            API_GROUP, API_VERSION_NAME, namespace, PLURAL, name, {"status": patch},
            _content_type=MERGE_PATCH, _request_timeout=TIMEOUT,
        )

    def delete_rljob(self, namespace: str, name: str) -> None:
        _ignore_missing(
            lambda: self.custom.delete_namespaced_custom_object(
                API_GROUP, API_VERSION_NAME, namespace, PLURAL, name,
                propagation_policy="Background", _request_timeout=TIMEOUT,
            )
        )

    # --- RayJobs ---------------------------------------------------------------------------

    def list_rayjobs(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        result = self.custom.list_namespaced_custom_object(
            RAY_GROUP, RAY_VERSION, namespace, RAYJOBS, label_selector=selector, _request_timeout=TIMEOUT
        )
        return list(result.get("items") or [])

    def patch_rayjob(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            RAY_GROUP, RAY_VERSION, namespace, RAYJOBS, name, patch,
            _content_type=MERGE_PATCH, _request_timeout=TIMEOUT,
        )

    def delete_rayjob(self, namespace: str, name: str) -> None:
        _ignore_missing(
            lambda: self.custom.delete_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAYJOBS, name,
                propagation_policy="Background", _request_timeout=TIMEOUT,
            )
        )

    # --- the RLJob's other children --------------------------------------------------------

    def update_configmap_data(self, namespace: str, name: str, data: dict[str, str]) -> None:
        self.core.patch_namespaced_config_map(
            name, namespace, {"data": data}, _content_type=MERGE_PATCH, _request_timeout=TIMEOUT
        )

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A ConfigMap, ServiceAccount, Role or RoleBinding, or None if there is none."""
        read = {
            "ConfigMap": self.core.read_namespaced_config_map,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Role": self.rbac.read_namespaced_role,
            "RoleBinding": self.rbac.read_namespaced_role_binding,
        }[kind]
        obj = _none_if_missing(lambda: read(name, namespace, _request_timeout=TIMEOUT))
        return None if obj is None else self._plain(obj)

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=TIMEOUT)
        return [self._plain(p) for p in pods.items]

    def create(self, obj: dict[str, Any]) -> bool:
        """Create a ConfigMap, ServiceAccount, Secret, Role, RoleBinding, NetworkPolicy or RayJob; False if
        it already existed.
        Raises InvalidObject when the API server refuses it as invalid (422)."""
        ns = obj["metadata"]["namespace"]
        kind = obj["kind"]
        if kind == "RayJob":
            def call() -> Any:
                return self.custom.create_namespaced_custom_object(
                    RAY_GROUP, RAY_VERSION, ns, RAYJOBS, obj, _request_timeout=TIMEOUT
                )
        else:
            create = {
                "ConfigMap": self.core.create_namespaced_config_map,
                "ServiceAccount": self.core.create_namespaced_service_account,
                "Secret": self.core.create_namespaced_secret,
                "Role": self.rbac.create_namespaced_role,
                "RoleBinding": self.rbac.create_namespaced_role_binding,
                "NetworkPolicy": self.networking.create_namespaced_network_policy,
            }[kind]

            def call() -> Any:
                return create(ns, obj, _request_timeout=TIMEOUT)
        try:
            call()
        except ApiException as exc:
            if exc.status == 409:
                log.debug("%s %s/%s already exists", kind, ns, obj["metadata"]["name"])
                return False
            if exc.status == 422:
                raise InvalidObject(kind, obj["metadata"]["name"], _status_body(exc).get("message") or str(exc.body))
            raise
        return True


def _none_if_missing(call: Any) -> Any:
    try:
        return call()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _ignore_missing(call: Any) -> None:
    try:
        call()
    except ApiException as exc:
        if exc.status != 404:
            raise


def api_error_status(exc: BaseException) -> int | None:
    """The HTTP status of an error the API server answered; None for any other error."""
    return exc.status if isinstance(exc, ApiException) else None


def api_unreachable(exc: BaseException) -> str | None:
    """Why the API server could not be reached ('Connection refused', ...), None for an error it
    answered or one of our own: a restarting API server is weather, not a bug to trace."""
    import urllib3.exceptions

    chain: BaseException | None = exc
    while chain is not None:
        if isinstance(chain, urllib3.exceptions.MaxRetryError) and chain.reason is not None:
            chain = chain.reason
        if isinstance(chain, (ConnectionError, urllib3.exceptions.ProtocolError, urllib3.exceptions.NewConnectionError,
                              urllib3.exceptions.TimeoutError)):
            errno_cause = next((c for c in (chain, *chain.args) if isinstance(c, OSError) and c.strerror), None)
            return errno_cause.strerror if errno_cause is not None else f"{type(chain).__name__}: {chain}"
        chain = chain.__cause__ or chain.__context__
    return None


def api_error_text(exc: BaseException) -> str:
    """'403 Forbidden: <the API server's message>' for an API error."""
    if not isinstance(exc, ApiException):
        return str(exc)
    message = _status_body(exc).get("message") or exc.body or ""
    return f"{exc.status} {exc.reason}: {message}"


def namespace_terminating(exc: BaseException) -> bool:
    """The API server refused a create because the namespace is being deleted."""
    causes = ((_status_body(exc).get("details") or {}).get("causes") or []) if isinstance(exc, ApiException) else []
    return any(c.get("reason") == "NamespaceTerminating" for c in causes)


def _status_body(exc: ApiException) -> dict[str, Any]:
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}
