"""Prompt data: the Sample type, prompt-set loading and the data source that feeds rollouts."""

from rlkube_runtime.data.dataset import (
    BUILTIN_PREFIX,
    DatasetError,
    builtin_dataset_names,
    load_prompt_dataset,
    load_prompt_dataset_from_spec,
    register_builtin_dataset,
)
from rlkube_runtime.data.sample import Message, Sample, SampleStatus
from rlkube_runtime.data.source import PromptSource

__all__ = [
    "BUILTIN_PREFIX",
    "DatasetError",
    "Message",
    "PromptSource",
    "Sample",
    "SampleStatus",
    "builtin_dataset_names",
    "load_prompt_dataset",
    "load_prompt_dataset_from_spec",
    "register_builtin_dataset",
]
