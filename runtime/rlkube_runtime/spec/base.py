"""The pieces every spec section shares: the model config, the reusable field types, and the one
error shape that cross-field checks raise.

Python attributes are snake_case; users (YAML, the CRD, `kubectl explain`) see camelCase. Unknown
fields are errors because a typo such as `batchSz` must never be dropped silently.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

API_GROUP = "rlkube.io"
API_VERSION_NAME = "v1alpha1"
API_VERSION = f"{API_GROUP}/{API_VERSION_NAME}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ("rlj",)

# The error type cross-field checks raise; `load.py` turns each violation into its own
# (path, message) pair under the path of the model that raised it.
CROSS_FIELD_ERROR = "rlkube_cross_field"


class SpecModel(BaseModel):
    """Base of every spec section: camelCase aliases, unknown fields rejected, strict types.

    Strict types because the API server rejects `batchSize: "32"` (a string for an integer);
    `rlkube validate` must not accept what `kubectl apply` would refuse.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        strict=True,
    )


def cross_field_error(violations: list[tuple[str, str]]) -> PydanticCustomError:
    """One error carrying every violated cross-field rule of a model.

    `violations` holds (field path relative to the model, message) pairs, e.g.
    ("epsClipHigh", "epsClipHigh(0.1) must be >= epsClip(0.2)"); an empty field path means the
    model itself (e.g. "set at least one of ...").
    """
    summary = "; ".join(f"{field}: {message}" if field else message for field, message in violations)
    return PydanticCustomError(CROSS_FIELD_ERROR, "{summary}", {"summary": summary, "violations": violations})


def spec_default(model_cls: type[BaseModel], field_name: str) -> Any:
    """The default of one spec field (snake_case name), for code that must agree with the spec
    without restating its values (the trainer's and reward step's config objects)."""
    field = model_cls.model_fields[field_name]
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def section(model_cls: type[BaseModel], description: str, *, rules: tuple[dict[str, str], ...] = ()) -> Any:
    """A spec section that may be omitted: it defaults to the section's own defaults.

    The CRD gets `default: {}` so the API server fills in the section's nested defaults too, and
    a stored object shows every value the job actually runs with. `rules` are extra CEL rules on
    the section's node (e.g. `immutable(...)`).
    """
    extra: dict[str, Any] = {"default": {}}
    if rules:
        extra["x-kubernetes-validations"] = [dict(r) for r in rules]
    return Field(default_factory=model_cls, description=description, json_schema_extra=extra)


def immutable(path: str) -> dict[str, str]:
    """A CEL transition rule: the field at spec.<path> keeps the value it was created with.

    The running job's checkpoints, data position and pod layout depend on these fields; changing
    them mid-run would corrupt a resume rather than reconfigure it. The operator also ignores such
    changes (with a Warning event) in case a CRD without these rules is installed.
    """
    return {
        "rule": "self == oldSelf",
        "message": f"spec.{path} cannot change while the RLJob exists: its checkpoints depend on it; "
        "create a new RLJob to change it",
    }


def immutable_field(path: str) -> dict[str, Any]:
    """`json_schema_extra` for a scalar field that must not change after creation."""
    return {"x-kubernetes-validations": [immutable(path)]}


# --- reusable field types -------------------------------------------------------------------

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
CALLABLE_PATH_PATTERN = rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$"
_CALLABLE_PATH_RE = re.compile(CALLABLE_PATH_PATTERN)


def _check_callable_path(value: str) -> str:
    if not _CALLABLE_PATH_RE.match(value):
        raise PydanticCustomError(
            "callable_path",
            "must name a Python callable as 'package.module:function' (e.g. 'my_pkg.rewards:score'), "
            "got '{value}'",
            {"value": value},
        )
    return value


CallablePath = Annotated[
    str,
    AfterValidator(_check_callable_path),
    Field(json_schema_extra={"pattern": CALLABLE_PATH_PATTERN}),
]
"""`package.module:function`; loaded by `rlkube_runtime.plugins.load_callable` at run time."""

# Dynamic-sampling filters rlkube ships (rlkube_runtime.rollout.filters), by the names slime gives
# them, also under slime's dotted path, so a slime user's setting works as written.
BUILTIN_FILTERS = ("check_reward_nonzero_std",)
SLIME_FILTER_MODULE = "slime.rollout.filter_hub.dynamic_sampling_filters"
_BUILTIN_FILTER_NAMES = BUILTIN_FILTERS + tuple(f"{SLIME_FILTER_MODULE}.{name}" for name in BUILTIN_FILTERS)


def builtin_filter_name(value: str) -> str | None:
    """The built-in filter `value` names (bare or by slime's path), else None."""
    return value.rsplit(".", 1)[-1] if value in _BUILTIN_FILTER_NAMES else None


def _check_filter_ref(value: str) -> str:
    if builtin_filter_name(value) is None and not _CALLABLE_PATH_RE.match(value):
        raise PydanticCustomError(
            "filter_ref",
            "must be a built-in filter ({builtins}) or a Python callable as 'package.module:function', got '{value}'",
            {"value": value, "builtins": ", ".join(BUILTIN_FILTERS)},
        )
    return value


FilterRef = Annotated[
    str,
    AfterValidator(_check_filter_ref),
    Field(json_schema_extra={"pattern": "^(" + "|".join(re.escape(n) for n in _BUILTIN_FILTER_NAMES) + "|"
                             + CALLABLE_PATH_PATTERN[1:-1] + ")$"}),
]
"""A built-in dynamic-sampling filter's name or `package.module:function`."""


def _require_scalar(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)):
        return value
    raise PydanticCustomError(
        "scalar_value",
        "must be a string, number or boolean (it becomes one command-line flag), got {kind}",
        {"kind": type(value).__name__},
    )


Scalar = Annotated[
    Union[str, int, float, bool],
    BeforeValidator(_require_scalar),
    # A union of scalar types is not structural in a CRD; any value is accepted there and
    # checked by `rlkube validate` and the runtime.
    WithJsonSchema({"x-kubernetes-preserve-unknown-fields": True}),
]
"""One command-line flag value passed through to Megatron, SGLang or the router."""

ScalarMap = dict[str, Scalar]

KubeObject = dict[str, Any]
"""A Kubernetes sub-object (ResourceRequirements, Toleration, Volume, EnvVar...), passed through
unchanged to the pods; the API server validates it when the operator creates them."""


def cel_rules(*rules: dict[str, str]) -> ConfigDict:
    """Model config attaching CEL rules (`x-kubernetes-validations`) to the model's CRD node.

    Each rule mirrors a Python check in the same model, so the API server and `rlkube validate`
    refuse the same specs. Rules only read scalar fields of their own node and its children, which
    keeps their estimated CEL cost constant. A messageExpression that shows numbers must use
    `'...%d...'.format([...])`: kube-apiserver (1.34) estimates `'...' + string(n)` as unbounded and
    refuses the whole CRD.
    """
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": [dict(rule) for rule in rules]})
