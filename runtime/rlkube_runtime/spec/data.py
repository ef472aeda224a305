"""`spec.data`: where prompts come from and which keys of each record mean what."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

from .base import SpecModel

BUILTIN_PREFIX = "builtin:"
DATA_PATH_PATTERN = r"^(builtin:[A-Za-z0-9][A-Za-z0-9_.-]*|.+\.(jsonl|parquet))$"
_DATA_PATH_RE = re.compile(DATA_PATH_PATTERN)


def _check_data_path(value: str) -> str:
    if not _DATA_PATH_RE.match(value):
        raise PydanticCustomError(
            "data_path",
            "must be a .jsonl or .parquet file path, or 'builtin:<task>' for a built-in synthetic task "
            "(e.g. 'builtin:digit-successor'), got '{value}'",
            {"value": value},
        )
    return value


DataPath = Annotated[
    str,
    AfterValidator(_check_data_path),
    Field(json_schema_extra={"pattern": DATA_PATH_PATTERN}),
]
"""A .jsonl/.parquet path, or `builtin:<task>` naming one of the project's synthetic tasks."""


def builtin_task_name(path: str) -> str | None:
    """The task name of a `builtin:<task>` data path, or None for a file path."""
    return path[len(BUILTIN_PREFIX):] if path.startswith(BUILTIN_PREFIX) else None


class DataSpec(SpecModel):
    """The prompt dataset and the record keys the rollout reads."""

    prompt_data: DataPath = Field(
        description="Prompt dataset: a .jsonl or .parquet file (one record per prompt), or "
        "'builtin:<task>' for a built-in synthetic task such as 'builtin:digit-successor'. Required.",
    )
    input_key: str = Field(default="prompt", min_length=1, description="Record key holding the prompt (a string, or a chat message list). Default 'prompt'.")
    label_key: str = Field(default="label", min_length=1, description="Record key holding the reference answer the reward compares against. Default 'label'.")
    metadata_key: str = Field(default="metadata", min_length=1, description="Record key holding per-sample metadata handed to reward and generate functions. Default 'metadata'.")
    tools_key: str = Field(default="tools", min_length=1, description="Record key holding tool definitions for chat templates and multi-turn rollouts. Default 'tools'.")
    apply_chat_template: bool = Field(default=False, description="Render prompts through the tokenizer's chat template before generation. Default false.")
    shuffle: bool = Field(default=True, description="Shuffle prompts each epoch (deterministically from seed). Default true.")
    seed: int = Field(default=42, description="Seed of the prompt shuffle. Default 42.")
