"""`spec.eval`: periodic evaluation on held-out datasets."""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import Field, model_validator

from .base import SpecModel, cel_rules, cross_field_error
from .data import DataPath, DataSpec


# On spec.eval, not on each dataset: a rule under a list is multiplied by its length in the API
# server's cost estimate (both lists are bounded: 64 datasets x 16 k values).
_PASS_K_RULE = {
    "rule": "!has(self.datasets) || self.datasets.all(d, !has(d.passK) || d.passK.all(k, k <= d.nSamples))",
    "message": "datasets[].passK: every k must be <= that dataset's nSamples: pass@k is estimated from nSamples "
    "responses per prompt",
    "fieldPath": ".datasets",
}


class EvalDatasetSpec(SpecModel):
    """One evaluation dataset; sampling settings left unset fall back to spec.rollout's."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Dataset name, used in metric labels (eval/<name>/...). Required; letters, digits, '_', '.', '-'.",
    )
    path: DataPath = Field(description="A .jsonl, .json or .parquet file, or 'builtin:<task>'. Required.")
    n_samples: int = Field(default=1, ge=1, description="Responses sampled per prompt. Default 1, >= 1.")
    max_response_len: Optional[int] = Field(
        default=None, ge=1, description="Maximum generated tokens per response. Default: rollout.maxResponseLen; >= 1."
    )
    temperature: Optional[float] = Field(default=None, ge=0, description="Sampling temperature. Default: rollout.temperature; >= 0.")
    top_p: Optional[float] = Field(default=None, gt=0, le=1, description="Nucleus sampling mass. Default: rollout.topP; in (0, 1].")
    input_key: Optional[str] = Field(default=None, min_length=1, description="Prompt key. Default: data.inputKey.")
    label_key: Optional[str] = Field(default=None, min_length=1, description="Label key. Default: data.labelKey.")
    pass_k: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        max_length=16,
        description="k values of pass@k (eval/<name>/pass_at_<k>): the chance that at least one of k responses to a "
        "prompt is correct (reward > 0), estimated without bias from the nSamples responses per prompt and averaged "
        "over prompts. Each 1 <= k <= nSamples. Default: none.",
    )

    def data_spec(self, data: DataSpec) -> DataSpec:
        """spec.data as this dataset reads it: its path and keys (the job's where unset), in file order."""
        return data.model_copy(update={
            "prompt_data": self.path,
            "input_key": self.input_key or data.input_key,
            "label_key": self.label_key or data.label_key,
            "shuffle": False,
        })


class EvalSpec(SpecModel):
    """When to evaluate and on what."""

    model_config = cel_rules(_PASS_K_RULE)

    interval: Optional[int] = Field(
        default=None,
        ge=1,
        description="Rollouts between evaluations (also run before the first rollout). Default: unset (no evaluation).",
    )
    datasets: list[EvalDatasetSpec] = Field(
        default_factory=list,
        max_length=64,
        description="Evaluation datasets, names unique. Default: none.",
        # A map keyed by name: the API server rejects two datasets with one name, as below.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    @model_validator(mode="after")
    def _check_datasets(self) -> "EvalSpec":
        """Unique names; every passK within its dataset's nSamples."""
        seen: set[str] = set()
        for i, dataset in enumerate(self.datasets):
            if dataset.name in seen:
                raise cross_field_error([(f"datasets[{i}].name", f"duplicate dataset name {dataset.name!r}; names must be unique")])
            seen.add(dataset.name)
        too_large = [(i, d, [k for k in d.pass_k if k > d.n_samples]) for i, d in enumerate(self.datasets)]
        # Reported at `datasets`, where the CRD's rule reports it too.
        problems = [
            f"datasets[{i}] ({d.name}): passK {ks} > nSamples({d.n_samples}); pass@k is estimated from nSamples "
            "responses per prompt: raise nSamples or lower k"
            for i, d, ks in too_large
            if ks
        ]
        if problems:
            raise cross_field_error([("datasets", "; ".join(problems))])
        return self
