"""`spec.checkpoint`: how often the full training state is saved to model.save."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import SpecModel


class CheckpointSpec(SpecModel):
    """Checkpoint cadence and retention. A checkpoint holds model, optimizer, scheduler, RNG, data
    position and the partial-rollout buffer, written atomically; a restarted job resumes from the
    latest complete one."""

    interval: Optional[int] = Field(
        default=None,
        ge=1,
        description="Rollouts between checkpoints written to model.save. Default: unset (no periodic checkpoints); >= 1.",
    )
    keep: Optional[int] = Field(
        default=None, ge=1, description="Most recent checkpoints kept; older ones are deleted. Default: unset (keep all); >= 1."
    )
    hf_export_interval: Optional[int] = Field(
        default=None,
        ge=1,
        description="Rollouts between Hugging Face exports of the trained weights (slime's --save-hf at an "
        "interval), each written atomically to <output>/hf_exports/rollout_<k>, k the rollouts trained so far, "
        "and kept. The final export to <output>/hf is written either way. Default: unset (the final one only); >= 1.",
    )
