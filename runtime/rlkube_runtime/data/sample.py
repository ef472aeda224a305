"""One prompt-response trajectory as it moves from the data source through rollout, reward and
training.

Follows slime's `slime/utils/types.py` Sample so its custom generate and reward functions port
over with few changes. `to_dict`/`from_dict` give a JSON-safe form: the data source writes it into
checkpoints (the partial-rollout buffer) and Ray actors can ship it without pickling classes.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Sequence

Message = dict[str, Any]
"""An OpenAI-style chat message: {"role": ..., "content": ...} plus optional tool-call keys."""


class SampleStatus(str, Enum):
    """Where a sample's generation ended; the engine's finish reason maps onto it."""

    PENDING = "pending"  # not generated yet
    COMPLETED = "completed"  # stopped on EOS or a stop string
    TRUNCATED = "truncated"  # hit max response length
    ABORTED = "aborted"  # generation was interrupted (weight sync, partial rollout)
    # A recoverable failure (tool call error, parser error); the partial output may still be usable.
    FAILED = "failed"


@dataclass
class Sample:
    """A trajectory: the prompt, the generated response and everything training needs about it.

    `tokens` holds prompt and response token ids back to back; the last `response_length` of them
    are the response. `loss_mask` and `rollout_log_probs`, when set, have one entry per response
    token; tool outputs inserted by a multi-turn generate function get loss_mask 0.
    """

    Status: ClassVar[type[SampleStatus]] = SampleStatus

    group_index: int | None = None  # which prompt group (n samples of one prompt share it)
    index: int | None = None  # global sample index, unique over the run
    rollout_id: int | None = None  # the rollout step that generated it
    # What the engine sees: the chat-templated text, or the prompt as given without a template.
    prompt: str | list[Message] = ""
    # The prompt as the data set had it (text or messages), before any chat template.
    raw_prompt: str | list[Message] | None = None
    tools: list[dict[str, Any]] | None = None  # tool schemas from the data set, if any
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None  # usually a string; any JSON value the reward function understands
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    # The engine's routed experts of every token but the last (routed_experts.py: SGLang's base64
    # int32 [tokens, layers, top_k]), kept under routing replay; replaced by each generation,
    # which routes the whole sequence again.
    routed_experts: str | None = None
    status: SampleStatus = SampleStatus.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[str] = field(default_factory=list)  # policy versions that generated it

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def effective_response_length(self) -> int:
        """Response tokens that count in the loss (tool outputs excluded)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def check_lengths(self) -> None:
        """Raise ValueError when the per-token fields disagree with response_length.

        The trainer slices log-probs and masks by response_length; a mismatch would silently
        shift every token, so it is caught here, before training.
        """
        problems = []
        if not 0 <= self.response_length <= len(self.tokens):
            problems.append(
                f"response_length {self.response_length} is outside 0..len(tokens)={len(self.tokens)}"
            )
        for name in ("loss_mask", "rollout_log_probs"):
            values = getattr(self, name)
            if values is not None and len(values) != self.response_length:
                problems.append(
                    f"len({name})={len(values)} != response_length {self.response_length}"
                )
        if problems:
            raise ValueError(
                f"sample index={self.index} group_index={self.group_index}: "
                + "; ".join(problems)
                + ". The generate function must append one entry per response token."
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe copy (plain dicts, lists, strings and numbers; status as its string)."""
        data = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Rebuild a Sample from `to_dict` output; unknown keys are an error, missing ones default."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"Sample.from_dict: unknown keys {unknown}; known keys are {sorted(known)}. "
                "The data was probably written by a newer rlkube version."
            )
        values = copy.deepcopy(dict(data))
        if "status" in values:
            try:
                values["status"] = SampleStatus(values["status"])
            except ValueError:
                allowed = [s.value for s in SampleStatus]
                raise ValueError(
                    f"Sample.from_dict: status {values['status']!r} is not one of {allowed}."
                ) from None
        return cls(**values)


def weight_version_number(version: str) -> int:
    """An engine's weight version as a number: its initial weights ("default") are version 0."""
    return 0 if version == "default" else int(version)


def syncs_behind(weight_versions: Sequence[str], trained_at: int, *, newest: bool = False) -> int:
    """How many weight syncs older than the policy of rollout `trained_at` (version `trained_at`)
    the weights that generated a sample are: by its oldest version, as a response whose generation
    spanned a sync is as old as its first tokens; by its newest where only those tokens train."""
    pick = max if newest else min
    return trained_at - pick(weight_version_number(v) for v in weight_versions)
