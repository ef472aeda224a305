"""YAML -> RLJob models, with every error turned into (field path, message) in the user's
camelCase names: `spec.rollout.batchSz: unknown field (did you mean 'batchSize'?)`.

The loader is stricter than plain `yaml.safe_load` where plain YAML would hide a mistake: a key
given twice is an error (PyYAML keeps the last one silently), and `1e-6` is a number as it is for
`kubectl` (YAML 1.1 would read it as a string).
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Union

import yaml
from pydantic import BaseModel, ValidationError

from .base import API_VERSION, CROSS_FIELD_ERROR, KIND
from .pod_policy import PodAllowance, pod_policy_violations
from .rljob import RLJob

ErrorList = list[tuple[str, str]]


class SpecError(ValueError):
    """An RLJob that cannot be loaded; `errors` holds (field path, message) pairs.

    `source` names where the object came from (a file), when known.
    """

    def __init__(self, errors: ErrorList, source: str | None = None):
        self.errors = list(errors)
        self.source = source
        super().__init__(str(self))

    def __reduce__(self):
        # Rebuilt from its fields, so it crosses process boundaries (Ray) intact.
        return type(self), (self.errors, self.source)

    def __str__(self) -> str:
        prefix = f"{self.source}: " if self.source else ""
        return "\n".join(f"{prefix}{path}: {message}" if path else f"{prefix}{message}" for path, message in self.errors)


# --- YAML ---------------------------------------------------------------------------------------


# libyaml's parser when PyYAML was built with it (10x faster); construction stays in Python.
_BaseSafeLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_BaseSafeLoader):  # type: ignore[misc, valid-type]
    """SafeLoader that rejects duplicate keys and reads exponent-only floats (1e-6) as numbers."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, typing.Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                    )
                if isinstance(key, typing.Hashable):
                    seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_documents(path: str | Path) -> list[tuple[int, Any]]:
    """The non-empty YAML documents of a file as (1-based position in the file, document).

    Raises SpecError naming the file (and line and column for malformed YAML).
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([("", f"cannot read file: {exc.strerror or exc}")], source) from exc
    return parse_documents(text, source)


def parse_documents(text: str, source: str = "<string>") -> list[tuple[int, Any]]:
    """Like load_documents, for YAML already in memory."""
    try:
        docs = list(yaml.load_all(text, Loader=_StrictLoader))  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "malformed"
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        raise SpecError([(where, f"invalid YAML: {problem}{context}")], source) from exc
    except yaml.YAMLError as exc:
        raise SpecError([("", f"invalid YAML: {exc}")], source) from exc
    return [(i, doc) for i, doc in enumerate(docs, start=1) if doc is not None]


# --- models ---------------------------------------------------------------------------------------


def document_name(doc: Any) -> str | None:
    """metadata.name of a document, if it has one."""
    if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
        name = doc["metadata"].get("name")
        return name if isinstance(name, str) else None
    return None


def parse_rljob(doc: Any, *, pod_policy: PodAllowance | None = None) -> RLJob:
    """Validate one object (as parsed from YAML or JSON) as an RLJob; raises SpecError.

    `pod_policy`: also refuse what the job's pods would reach beyond it (see pod_policy.py), as the
    cluster's admin allows it in the job's namespace; None (what `rlkube run` passes, which makes
    no pods): no such check."""
    if not isinstance(doc, dict):
        raise SpecError([("", f"expected an RLJob object (a mapping), got {_kind_of(doc)}")])
    envelope = _envelope_errors(doc)
    if envelope:
        # A different kind of object: its spec would only add noise.
        raise SpecError(envelope)
    try:
        job = _validate_by_alias(doc)
    except ValidationError as exc:
        raise SpecError(validation_errors(exc)) from None
    if pod_policy is not None:
        violations = pod_policy_violations(job.spec, pod_policy)
        if violations:
            raise SpecError([(f"spec.{path}", message) for path, message in violations])
    return job


def _validate_by_alias(doc: dict[str, Any]) -> RLJob:
    """YAML must use the camelCase names the API server knows: snake_case would pass here and be
    pruned there. (pydantic < 2.11 has no per-call by_name and accepts both.)"""
    try:
        return RLJob.model_validate(doc, by_alias=True, by_name=False)
    except TypeError:
        return RLJob.model_validate(doc)


def load_rljobs(path: str | Path) -> list[RLJob]:
    """Every RLJob in a YAML file (one or many documents); raises SpecError listing all errors."""
    jobs: list[RLJob] = []
    errors: ErrorList = []
    docs = load_documents(path)
    if not docs:
        raise SpecError([("", "no YAML documents in file")], str(path))
    for index, doc in docs:
        try:
            jobs.append(parse_rljob(doc))
        except SpecError as exc:
            label = f"doc {index} ({document_name(doc) or 'unnamed'})"
            errors.extend((f"{label}: {p}" if p else label, m) for p, m in exc.errors)
    if errors:
        raise SpecError(errors, str(path))
    return jobs


def load_rljob(path: str | Path) -> RLJob:
    """The one RLJob in a YAML file (what `rlkube run FILE` runs); raises SpecError otherwise."""
    jobs = load_rljobs(path)
    if len(jobs) != 1:
        names = ", ".join(job.metadata.name for job in jobs)
        raise SpecError([("", f"expected exactly one RLJob, found {len(jobs)} ({names}); put each job in its own file")], str(path))
    return jobs[0]


def _envelope_errors(doc: dict[str, Any]) -> ErrorList:
    errors: ErrorList = []
    for key, expected in (("apiVersion", API_VERSION), ("kind", KIND)):
        if key not in doc:
            errors.append((key, f"required field is missing; must be {expected!r}"))
        elif doc[key] != expected:
            errors.append((key, f"must be {expected!r}, got {doc[key]!r}"))
    return errors


# --- pydantic errors -> (path, message) -----------------------------------------------------------

# Error types whose message already names the offending value.
_SELF_DESCRIBING = {CROSS_FIELD_ERROR, "value_error", "missing", "extra_forbidden", "callable_path", "data_path", "scalar_value"}


def validation_errors(exc: ValidationError, root: type[BaseModel] = RLJob) -> ErrorList:
    """(path, message) pairs for a pydantic ValidationError of `root`, in camelCase paths."""
    errors: ErrorList = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        path = format_loc(loc)
        if err["type"] == CROSS_FIELD_ERROR:
            for field, message in err["ctx"]["violations"]:
                errors.append((".".join(p for p in (path, field) if p), message))
            continue
        errors.append((path, _message(err, root, loc)))
    return errors


def format_loc(loc: Iterable[Union[str, int]]) -> str:
    """('spec', 'eval', 'datasets', 0, 'name') -> 'spec.eval.datasets[0].name'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(err: dict[str, Any], root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_field_message(root, loc)
    if kind == "missing":
        return "required field is missing"
    if kind in ("literal_error", "enum"):
        return f"invalid value {err['input']!r}; allowed values: {err['ctx']['expected']}"
    message = err["msg"]
    message = message.removeprefix("Value error, ")
    message = re.sub(r"^Input should be", "must be", message)
    message = re.sub(r"valid dictionary( or instance of \w+)?", "mapping", message)
    if kind not in _SELF_DESCRIBING:
        message += f", got {_describe(err.get('input'))}"
    return message


def _describe(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return _kind_of(value)
    return f"{value!r} ({_kind_of(value)})" if isinstance(value, str) else repr(value)


def _kind_of(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _unknown_field_message(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    model = _model_at(root, loc[:-1])
    if model is None:
        return "unknown field"
    known = [field.alias or name for name, field in model.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(known)}"
    return f"unknown field ({hint})"


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class found by following `loc` (aliases, list indices) down from `root`."""
    current: Any = root
    for part in loc:
        current = _unwrap(current)
        if isinstance(part, int):
            args = typing.get_args(current)
            current = args[0] if args else None
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        fields = {(f.alias or n): f for n, f in current.model_fields.items()}
        if part not in fields:
            return None
        current = fields[part].annotation
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """Optional[X] -> X; other annotations unchanged."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
