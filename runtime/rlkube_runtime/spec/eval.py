"""`spec.eval`: periodic evaluation on held-out datasets."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import SpecModel
from .data import DataPath


class EvalDatasetSpec(SpecModel):
    """One evaluation dataset; sampling settings left unset fall back to spec.rollout's."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Dataset name, used in metric labels (eval/<name>/...). Required; letters, digits, '_', '.', '-'.",
    )
    path: DataPath = Field(description="A .jsonl or .parquet file, or 'builtin:<task>'. Required.")
    n_samples: int = Field(default=1, ge=1, description="Responses sampled per prompt. Default 1, >= 1.")
    max_response_len: Optional[int] = Field(default=None, ge=1, description="Default: rollout.maxResponseLen; >= 1.")
    temperature: Optional[float] = Field(default=None, ge=0, description="Default: rollout.temperature; >= 0.")
    top_p: Optional[float] = Field(default=None, gt=0, le=1, description="Default: rollout.topP; in (0, 1].")
    input_key: Optional[str] = Field(default=None, min_length=1, description="Prompt key. Default: data.inputKey.")
    label_key: Optional[str] = Field(default=None, min_length=1, description="Label key. Default: data.labelKey.")


class EvalSpec(SpecModel):
    """When to evaluate and on what."""

    interval: Optional[int] = Field(
        default=None,
        ge=1,
        description="Rollouts between evaluations (also run before the first rollout). Default: unset (no evaluation).",
    )
    datasets: list[EvalDatasetSpec] = Field(
        default_factory=list, max_length=64, description="Evaluation datasets. Default: none."
    )
