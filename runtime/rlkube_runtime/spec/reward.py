"""`spec.reward`: how a finished response is scored."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .base import CallablePath, SpecModel, cel_rules, cross_field_error

RewardType = Literal["math", "dapo", "deepscaler", "f1", "exact", "remote", "custom"]

_CUSTOM_NEEDS_PATH = "reward type 'custom' needs customPath ('package.module:function')"
_REMOTE_NEEDS_URL = "reward type 'remote' needs url (the reward service endpoint)"


class RewardSpec(SpecModel):
    """The reward function: a built-in rule, a remote service, or user code."""

    model_config = cel_rules(
        {"rule": "self.type != 'custom' || has(self.customPath)", "message": _CUSTOM_NEEDS_PATH, "fieldPath": ".customPath"},
        {"rule": "self.type != 'remote' || has(self.url)", "message": _REMOTE_NEEDS_URL, "fieldPath": ".url"},
    )

    type: RewardType = Field(
        description="Reward function. math: boxed-answer equivalence; dapo: DAPO math answer match (+1/-1); "
        "deepscaler: DeepScaleR answer match; f1: token F1 against the label; exact: exact string match; "
        "remote: POST to url; custom: the function at customPath. Required.",
    )
    custom_path: Optional[CallablePath] = Field(
        default=None,
        description="'package.module:function' scoring one sample (sync or async); required when type is custom.",
    )
    url: Optional[str] = Field(
        default=None,
        min_length=1,
        description="Reward service endpoint (http or https) receiving each sample as JSON; required when type is remote.",
    )
    timeout_seconds: float = Field(
        default=30, gt=0, description="Per-request timeout of a remote or custom reward call, in seconds. Default 30, > 0."
    )
    max_retries: int = Field(
        default=3, ge=0, description="Retries of a failed remote reward call before the sample fails. Default 3, >= 0."
    )
    group_reward_function: Optional[CallablePath] = Field(
        default=None,
        description="'package.module:function' scoring a whole group of samples at once (e.g. pairwise "
        "judging); replaces per-sample scoring when set. Default: unset.",
    )

    @model_validator(mode="after")
    def _check_type_requirements(self) -> "RewardSpec":
        if self.type == "custom" and self.custom_path is None:
            raise cross_field_error([("customPath", _CUSTOM_NEEDS_PATH)])
        if self.type == "remote" and self.url is None:
            raise cross_field_error([("url", _REMOTE_NEEDS_URL)])
        return self
