"""What an RLJob's pods may reach beyond the job itself, and what a cluster admin allows on top.

The operator creates the job's pods with its own rights, so a field that widens a pod's reach
would let someone who may create RLJobs (but not pods) reach the host, another team's Secrets or
a service account's token through the operator. Such fields are refused unless the admin allows
them, per namespace, in the operator's settings (the chart's `podPolicy` values, which also feed
the chart's admission policy, so `kubectl apply` refuses the same specs):

- volumes: configMap, downwardAPI, emptyDir, ephemeral and persistentVolumeClaim always; any
  other source (hostPath, secret, projected, csi, nfs, ...) only when listed in `volumeTypes`,
  and a `secret` volume only of a Secret named in `secretNames`;
- `env[].valueFrom.secretKeyRef` only of a Secret named in `secretNames` (the way for a job's own
  Secrets is `resources.secretEnv`, whose Secrets the admission policy checks the author may read);
- images (`resources.trainer.image`, `resources.rollout.image`) only from `imageRegistries` when
  that list is set.

Host namespaces, privileges, capabilities and service accounts have no field in the spec at all
(unknown fields are refused), and `volumeMounts[].mountPropagation: Bidirectional` is refused
always (it needs a privileged container).

`rlkube validate` applies the default (or `--policy FILE`), the operator its settings; `rlkube run`
makes no pods and applies none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import Field, ValidationError

from .base import SpecModel
from .rljob import RLJobSpec

# Volume sources that reach nothing beyond the job's namespace and its own data: what the
# `restricted` Pod Security Standard allows, less secret, projected (service-account tokens,
# Secrets) and csi (a driver may mount anything, e.g. a secrets store).
SAFE_VOLUME_TYPES = ("configMap", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim")
SECRET_VOLUME = "secret"
POLICY_SETTING = "podPolicy"  # the chart value and the key of the operator's policy file
# The admission policy checks the author may `get` each Secret, ConfigMap and claim a job names, one
# authorization check each; at 350000 of the API server's 10000000 CEL budget per request, a job
# names at most this many of each kind.
MAX_NAMED_OBJECTS = 6


class PodAllowance(SpecModel):
    """What the admin allows the RLJobs of a namespace beyond the safe default."""

    volume_types: list[str] = Field(
        default_factory=list,
        description="Volume sources allowed beyond configMap, downwardAPI, emptyDir, ephemeral and "
        "persistentVolumeClaim, e.g. [nfs, csi]; hostPath only where the namespace may reach its nodes. "
        "secret here allows secret volumes of any Secret; without it only of those in secretNames. Default: none.",
    )
    secret_names: list[str] = Field(
        default_factory=list,
        description="Secrets (of the job's namespace) that secret volumes and env valueFrom.secretKeyRef may "
        "name. Default: none (a job's own Secrets go through resources.secretEnv).",
    )
    image_registries: list[str] = Field(
        default_factory=list,
        description="Image name prefixes the job's images must start with, e.g. registry.example.com/rl/. "
        "Default: none (any image).",
    )


class PodPolicy(SpecModel):
    """The admin's allowances: `default` for every namespace; an entry of `namespaces` replaces the
    default's value of each field it sets, for that namespace."""

    default: PodAllowance = Field(default_factory=PodAllowance, description="Allowances in every namespace.")
    namespaces: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per namespace: fields of PodAllowance replacing the default's."
    )

    def allowance(self, namespace: str | None) -> PodAllowance:
        """The allowance in force in `namespace` (the default when it has no entry)."""
        own = self.namespaces.get(namespace or "") or {}
        return PodAllowance.model_validate({**self.default.model_dump(by_alias=True), **own})


DEFAULT_POLICY = PodPolicy()


def load_pod_policy(path: str | Path) -> PodPolicy:
    """The policy in a YAML file: a PodPolicy, or a mapping holding one under `podPolicy` (the chart's
    values file works as it is). Raises ValueError naming the file and the field."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read the pod policy: {exc}") from None
    if isinstance(doc, dict) and POLICY_SETTING in doc:
        doc = doc[POLICY_SETTING] or {}
    try:
        policy = PodPolicy.model_validate(doc)
        for namespace in policy.namespaces:
            policy.allowance(namespace)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
        raise ValueError(f"{path}: not a pod policy: {problems}") from None
    return policy


def pod_policy_violations(spec: RLJobSpec, allowance: PodAllowance) -> list[tuple[str, str]]:
    """(field path under spec, message) for each field reaching beyond what `allowance` permits."""
    res = spec.resources
    allowed_types = (*SAFE_VOLUME_TYPES, *allowance.volume_types)
    out: list[tuple[str, str]] = []
    for i, volume in enumerate(res.volumes):
        for source in (key for key in volume if key != "name"):
            path = f"resources.volumes[{i}].{source}"
            if source == SECRET_VOLUME and source not in allowance.volume_types:
                secret = (volume.get(source) or {}).get("secretName") if isinstance(volume.get(source), dict) else None
                if secret not in allowance.secret_names:
                    out.append((f"{path}.secretName", _secret_message(secret, "a secret volume", allowance)))
            elif source not in allowed_types:
                out.append((path, (
                    f"{source} volumes are not allowed: the operator would mount them with its own rights; allowed: "
                    f"{', '.join(allowed_types)} (the cluster admin may allow more in the operator's "
                    f"{POLICY_SETTING}.volumeTypes)"
                )))
    for i, var in enumerate(res.env):
        ref = (var.get("valueFrom") or {}).get("secretKeyRef") if isinstance(var.get("valueFrom"), dict) else None
        if ref is not None:
            secret = ref.get("name") if isinstance(ref, dict) else None
            if secret not in allowance.secret_names:
                out.append((f"resources.env[{i}].valueFrom.secretKeyRef.name",
                            _secret_message(secret, "an env secretKeyRef", allowance)))
    for kind, names in named_objects(spec).items():
        if len(set(names)) > MAX_NAMED_OBJECTS:
            out.append(("resources", (
                f"the job names {len(set(names))} {kind}; at most {MAX_NAMED_OBJECTS}: each is checked against your "
                "own access"
            )))
    if allowance.image_registries:
        for group in ("trainer", "rollout"):
            image = getattr(res, group).image
            if image is not None and not image.startswith(tuple(allowance.image_registries)):
                out.append((f"resources.{group}.image", (
                    f"image {image!r} is not from an allowed registry: {', '.join(allowance.image_registries)} "
                    f"(the operator's {POLICY_SETTING}.imageRegistries)"
                )))
    return out


def named_objects(spec: RLJobSpec) -> dict[str, list[str]]:
    """The Secrets, ConfigMaps and PersistentVolumeClaims the job's pods read by name (what the
    admission policy checks the author may get)."""
    res = spec.resources
    secrets = [v.secret_name for v in res.secret_env] + [s.name for s in res.image_pull_secrets]
    configmaps: list[str] = []
    claims: list[str] = []
    for volume in res.volumes:
        source = {key: value for key, value in volume.items() if isinstance(value, dict)}
        if "secret" in source and "secretName" in source["secret"]:
            secrets.append(str(source["secret"]["secretName"]))
        if "configMap" in source and "name" in source["configMap"]:
            configmaps.append(str(source["configMap"]["name"]))
        if "persistentVolumeClaim" in source and "claimName" in source["persistentVolumeClaim"]:
            claims.append(str(source["persistentVolumeClaim"]["claimName"]))
    for var in res.env:
        value_from = var.get("valueFrom") if isinstance(var.get("valueFrom"), dict) else {}
        for key, into in (("secretKeyRef", secrets), ("configMapKeyRef", configmaps)):
            ref = value_from.get(key)
            if isinstance(ref, dict) and "name" in ref:
                into.append(str(ref["name"]))
    return {"Secrets": secrets, "ConfigMaps": configmaps, "PersistentVolumeClaims": claims}


def _secret_message(secret: Optional[str], what: str, allowance: PodAllowance) -> str:
    allowed = ", ".join(allowance.secret_names) or "none"
    return (
        f"Secret {secret!r} may not be read through {what}: the operator would read it with its own rights "
        f"(Secrets the cluster admin allows here, {POLICY_SETTING}.secretNames: {allowed}); give the job its own "
        "Secrets through resources.secretEnv, which checks that you may read them"
    )
