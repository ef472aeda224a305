"""`spec.data`: where prompts come from and which keys of each record mean what."""

from __future__ import annotations

import re
from typing import Annotated, Any, Optional

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from .base import SpecModel, cel_rules, cross_field_error

BUILTIN_PREFIX = "builtin:"
PROMPT_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
"""The prompt file formats data/dataset.py reads, and so the only ones the spec accepts."""
DATA_PATH_PATTERN = (r"^(builtin:[A-Za-z0-9][A-Za-z0-9_.-]*|.+\.("
                     + "|".join(s.lstrip(".") for s in PROMPT_FILE_SUFFIXES) + "))$")
_DATA_PATH_RE = re.compile(DATA_PATH_PATTERN)


def _check_data_path(value: str) -> str:
    if not _DATA_PATH_RE.match(value):
        raise PydanticCustomError(
            "data_path",
            "must be a .jsonl, .json or .parquet file path, or 'builtin:<task>' for a built-in synthetic task "
            "(e.g. 'builtin:digit-successor'), got '{value}'",
            {"value": value},
        )
    return value


DataPath = Annotated[
    str,
    AfterValidator(_check_data_path),
    Field(json_schema_extra={"pattern": DATA_PATH_PATTERN}),
]
"""A .jsonl/.json/.parquet path, or `builtin:<task>` naming one of the project's synthetic tasks."""


def builtin_task_name(path: str) -> str | None:
    """The task name of a `builtin:<task>` data path, or None for a file path."""
    return path[len(BUILTIN_PREFIX):] if path.startswith(BUILTIN_PREFIX) else None


_KWARGS_NEED_TEMPLATE = ("chatTemplateKwargs go to the tokenizer's chat template, which renders prompts only "
                         "with applyChatTemplate: true; set it or remove chatTemplateKwargs")


class DataSpec(SpecModel):
    """The prompt dataset and the record keys the rollout reads."""

    model_config = cel_rules({
        # The field keeps unknown fields, so CEL sees an object without size(): being set is the test.
        "rule": "!has(self.chatTemplateKwargs) || (has(self.applyChatTemplate) && self.applyChatTemplate)",
        "message": _KWARGS_NEED_TEMPLATE,
        "fieldPath": ".chatTemplateKwargs",
    })

    prompt_data: DataPath = Field(
        description="Prompt dataset: a .jsonl file (one record per line), a .json file (one array of "
        "records, or JSON lines) or a .parquet file (one row per prompt), or "
        "'builtin:<task>' for a built-in synthetic task such as 'builtin:digit-successor'. Required.",
    )
    input_key: str = Field(default="prompt", min_length=1, description="Record key holding the prompt (a string, or a chat message list). Default 'prompt'.")
    label_key: str = Field(default="label", min_length=1, description="Record key holding the reference answer the reward compares against. Default 'label'.")
    metadata_key: str = Field(default="metadata", min_length=1, description="Record key holding per-sample metadata handed to reward and generate functions. Default 'metadata'.")
    tools_key: str = Field(default="tools", min_length=1, description="Record key holding tool definitions for chat templates and multi-turn rollouts. Default 'tools'.")
    apply_chat_template: bool = Field(default=False, description="Render prompts through the tokenizer's chat template before generation. Default false.")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        default=None,
        description="Extra variables for the chat template, as slime's --apply-chat-template-kwargs "
        "(e.g. {enable_thinking: false} for Qwen3). Needs applyChatTemplate: true. Default: none.",
    )
    shuffle: bool = Field(default=True, description="Shuffle prompts each epoch (deterministically from seed). Default true.")
    seed: int = Field(default=42, description="Seed of the prompt shuffle. Default 42.")

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "DataSpec":
        if self.chat_template_kwargs is not None and not self.apply_chat_template:
            raise cross_field_error([("chatTemplateKwargs", _KWARGS_NEED_TEMPLATE)])
        return self
