"""Load a prompt set (JSONL, JSON, Parquet or a registered built-in task) into Samples.

Every record is checked before training starts, so a bad line fails the job at once with the file
and line instead of crashing a rollout hours later. The operator treats these errors as permanent
(no restart can fix the data).

Keys per record (names configurable, as slime's --input-key/--label-key/...):
  prompt    text, or a list of OpenAI-style messages ({"role", "content"}; `tool` messages kept)
  label     any JSON value the reward function understands (required unless label_key is None)
  metadata  optional object (a JSON string is accepted, as Parquet exports often store one)
  tools     optional list of tool schemas (or its JSON string), handed to the chat template
"""

from __future__ import annotations

import importlib
import json
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from rlkube_runtime.data.sample import Sample
from rlkube_runtime.spec.data import BUILTIN_PREFIX, PROMPT_FILE_SUFFIXES

BuiltinFactory = Callable[[], Iterable[Mapping[str, Any]]]
"""Returns the task's records, with the same keys a JSONL line would have."""

_BUILTIN_DATASETS: dict[str, BuiltinFactory] = {}

# Modules that register built-in prompt sets when imported; a `builtin:` lookup imports them first
# so that no caller has to remember to.
BUILTIN_PROVIDERS: tuple[str, ...] = ("rlkube_runtime.tiny.task",)


class DatasetError(ValueError):
    """The prompt data cannot be used as given; the message names the file and record."""


def register_builtin_dataset(name: str, factory: BuiltinFactory) -> BuiltinFactory:
    """Make `builtin:<name>` a prompt set; the task module calls this when it is imported.

    Registering the same factory twice is a no-op (module reloads); a different factory under a
    taken name is an error, so two tasks cannot silently shadow each other.
    """
    if not name or name != name.strip() or ":" in name:
        raise ValueError(
            f"builtin dataset name must be non-empty without ':' or spaces, got {name!r}"
        )
    existing = _BUILTIN_DATASETS.get(name)
    if existing is not None and existing is not factory:
        raise ValueError(f"builtin dataset {name!r} is already registered by {existing!r}")
    _BUILTIN_DATASETS[name] = factory
    return factory


def builtin_dataset_names() -> list[str]:
    return sorted(_BUILTIN_DATASETS)


def load_prompt_dataset(
    path: str | pathlib.Path,
    *,
    tokenizer: Any = None,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str = "metadata",
    tools_key: str = "tools",
    apply_chat_template: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[Sample]:
    """Read every record of `path` into a pending Sample, in file order.

    With apply_chat_template, `Sample.prompt` is the tokenizer's templated text (generation prompt
    appended, tools passed as `tools=`) and `Sample.raw_prompt` keeps the record's prompt.
    Raises DatasetError naming the file and line (JSONL, 1-based) or row index (Parquet, 0-based).
    """
    if apply_chat_template and tokenizer is None:
        raise DatasetError(
            f"{path}: apply_chat_template is on but no tokenizer was given; pass the model's "
            "tokenizer or turn data.applyChatTemplate off."
        )
    source = str(path)
    samples = [
        _record_to_sample(
            record,
            where,
            tokenizer=tokenizer,
            input_key=input_key,
            label_key=label_key or None,
            metadata_key=metadata_key,
            tools_key=tools_key,
            apply_chat_template=apply_chat_template,
            chat_template_kwargs=dict(chat_template_kwargs or {}),
        )
        for where, record in _read_records(source, input_key=input_key, label_key=label_key or None)
    ]
    if not samples:
        raise DatasetError(f"{source}: the prompt set is empty; it needs at least one record.")
    return samples


def load_prompt_dataset_from_spec(data_spec: Any, *, tokenizer: Any = None) -> list[Sample]:
    """`load_prompt_dataset` with the fields of a DataSpec (read by attribute)."""
    return load_prompt_dataset(
        data_spec.prompt_data,
        tokenizer=tokenizer,
        input_key=data_spec.input_key,
        label_key=data_spec.label_key,
        metadata_key=data_spec.metadata_key,
        tools_key=data_spec.tools_key,
        apply_chat_template=data_spec.apply_chat_template,
        chat_template_kwargs=data_spec.chat_template_kwargs,
    )


# --- reading records ------------------------------------------------------------------------


def _read_records(
    source: str, *, input_key: str, label_key: str | None
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Yield (where, record), where `where` says where the record came from for error messages."""
    if source.startswith(BUILTIN_PREFIX):
        yield from _read_builtin(source[len(BUILTIN_PREFIX) :])
        return
    path = pathlib.Path(source)
    if not path.is_file():
        raise DatasetError(
            f"prompt data file {source} does not exist (or is not a file); check data.promptData "
            "and that the volume holding it is mounted."
        )
    read = _FILE_READERS.get(path.suffix)
    if read is None:
        raise DatasetError(
            f"prompt data file {source}: unsupported format {path.suffix or '(no suffix)'!r}; "
            f"use {', '.join(PROMPT_FILE_SUFFIXES[:-1])} or {PROMPT_FILE_SUFFIXES[-1]}, "
            f"or {BUILTIN_PREFIX}<name> for a built-in task."
        )
    yield from read(path, [k for k in (input_key, label_key) if k])


def _read_builtin(name: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for module in BUILTIN_PROVIDERS:
        importlib.import_module(module)
    factory = _BUILTIN_DATASETS.get(name)
    if factory is None:
        raise DatasetError(
            f"unknown built-in prompt set {BUILTIN_PREFIX}{name}; known: "
            f"{[BUILTIN_PREFIX + n for n in builtin_dataset_names()]}."
        )
    for i, record in enumerate(factory()):
        where = f"{BUILTIN_PREFIX}{name} record {i}"
        if not isinstance(record, Mapping):
            raise DatasetError(f"{where}: expected a mapping, got {type(record).__name__}.")
        yield where, record


def _read_jsonl(path: pathlib.Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) carry no record
            where = f"{path} line {lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{where}: malformed JSON ({exc.msg} at column {exc.colno}); each line must "
                    "be one JSON object."
                ) from None
            yield where, _json_object(where, record)


def _read_json(path: pathlib.Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """A `.json` file as the Hub has them: one JSON array of objects, or JSON lines after all."""
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        yield from _read_jsonl(path)
        return
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(
            f"{path} line {exc.lineno}: malformed JSON ({exc.msg} at column {exc.colno}); a .json prompt file is one "
            "JSON array of objects or one JSON object per line."
        ) from None
    for i, record in enumerate(records):
        where = f"{path} item {i}"
        yield where, _json_object(where, record)


def _json_object(where: str, record: Any) -> Mapping[str, Any]:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}.")
    return record


def _read_parquet(
    path: pathlib.Path, *, required: list[str]
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    import pyarrow.parquet as pq  # only Parquet users pay for the import

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DatasetError(
            f"{path}: cannot read as Parquet ({type(exc).__name__}: {exc})."
        ) from exc
    missing = [k for k in required if k not in table.column_names]
    if missing:
        raise DatasetError(
            f"{path}: missing column(s) {missing}; columns are {table.column_names}. "
            "Set data.inputKey / data.labelKey to the right columns."
        )
    for i, record in enumerate(table.to_pylist()):
        yield f"{path} row index {i}", record


# --- one record -> Sample ------------------------------------------------------------------


# One reader per suffix the spec accepts (spec.data.PROMPT_FILE_SUFFIXES; a test keeps them equal).
_FILE_READERS: dict[str, Callable[[pathlib.Path, list[str]], Iterator[tuple[str, Mapping[str, Any]]]]] = {
    ".jsonl": lambda path, required: _read_jsonl(path),
    ".json": lambda path, required: _read_json(path),
    ".parquet": lambda path, required: _read_parquet(path, required=required),
}


def _record_to_sample(
    record: Mapping[str, Any],
    where: str,
    *,
    tokenizer: Any,
    input_key: str,
    label_key: str | None,
    metadata_key: str,
    tools_key: str,
    apply_chat_template: bool,
    chat_template_kwargs: dict[str, Any],
) -> Sample:
    raw_prompt = _prompt_field(
        _required(record, input_key, where, "data.inputKey"), where, input_key
    )
    label = _required(record, label_key, where, "data.labelKey") if label_key else None
    metadata = _json_field(record.get(metadata_key), where, metadata_key, dict) or {}
    tools = _json_field(record.get(tools_key), where, tools_key, list)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise DatasetError(f"{where}: {tools_key!r} must be a list of tool schema objects.")

    for key, value in (
        (input_key, raw_prompt),
        (label_key, label),
        (metadata_key, metadata),
        (tools_key, tools),
    ):
        _check_json_safe(value, where, key)

    prompt: str | list[dict[str, Any]] = raw_prompt
    if apply_chat_template:
        messages = (
            [{"role": "user", "content": raw_prompt}] if isinstance(raw_prompt, str) else raw_prompt
        )
        try:
            prompt = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **chat_template_kwargs,
            )
        except Exception as exc:  # jinja raises TemplateError, templates may raise anything
            raise DatasetError(
                f"{where}: the tokenizer's chat template failed ({type(exc).__name__}: {exc})."
            ) from exc
    return Sample(prompt=prompt, raw_prompt=raw_prompt, tools=tools, label=label, metadata=metadata)


def _required(record: Mapping[str, Any], key: str, where: str, field: str) -> Any:
    if key not in record:
        raise DatasetError(
            f"{where}: missing key {key!r} (keys present: {sorted(record)}); set {field} to the "
            "key that holds it."
        )
    return record[key]


def _prompt_field(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    ):
        # Parquet struct columns give every message every key seen in the column (None when
        # absent); chat templates test `'tool_calls' in message`, so the Nones are dropped.
        return [{k: v for k, v in m.items() if v is not None} for m in value]
    raise DatasetError(
        f"{where}: {key!r} must be a string or a non-empty list of messages with a string 'role', "
        f"got {type(value).__name__} {_preview(value)}."
    )


def _json_field(value: Any, where: str, key: str, expected: type) -> Any:
    """None stays None; a JSON string is decoded; the result must be of `expected` type."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"{where}: {key!r} is a string but not valid JSON ({exc.msg})."
            ) from None
    if not isinstance(value, expected):
        raise DatasetError(
            f"{where}: {key!r} must be a JSON {expected.__name__} "
            f"({'object' if expected is dict else 'array'}), got {type(value).__name__} {_preview(value)}."
        )
    return value


def _check_json_safe(value: Any, where: str, key: str | None) -> None:
    """Samples travel as JSON (checkpointed buffers, Ray); Parquet can hold timestamps or bytes."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise DatasetError(
            f"{where}: {key!r} holds a value JSON cannot represent ({exc}); convert it to a "
            "string or number in the data set."
        ) from None


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
