"""The block `rlkube run` prints at its end: what the run did and where its results are.

Fed one rollout at a time with the same metrics dict the logger gets, so it reports what was
logged: rollouts done, the reward of the first and last of them, the median seconds of each phase,
the checkpoint, the Hugging Face export, and the command that continues.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping

# (label, metric) of the phases whose median time the block shows, in loop order.
PHASES = (
    ("generate", "perf/rollout_time"),
    ("train", "perf/actor_train_time"),
    ("weight sync", "perf/update_weights_time"),
    ("eval", "perf/eval_time"),
    ("whole step", "perf/step_time"),
)


@dataclass
class RunSummary:
    job_name: str
    num_rollout: int  # rollouts the job runs in all (this mode's count)
    rollouts: list[int] = field(default_factory=list)  # ids logged by this start
    rewards: list[tuple[int, float]] = field(default_factory=list)
    phase_seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, rollout_id: int, metrics: Mapping[str, Any]) -> None:
        self.rollouts.append(rollout_id)
        reward = metrics.get("rollout/raw_reward")
        if isinstance(reward, (int, float)):
            self.rewards.append((rollout_id, float(reward)))
        for _label, key in PHASES:
            value = metrics.get(key)
            if isinstance(value, (int, float)):
                self.phase_seconds.setdefault(key, []).append(float(value))

    def render(
        self, *, finished: bool, checkpoint: str | None, hf_export: str | None, next_steps: list[tuple[str, str]],
        done_before: int = 0,
    ) -> str:
        """The block, one fact a line; `next_steps` are (label, text) lines saying how to go on;
        `done_before` counts the rollouts an earlier start had saved (what a resume began from)."""
        lines = [f"== rlkube run {self.job_name}: {'done' if finished else 'stopped'} =="]
        if self.rollouts:
            last = max(self.rollouts)
            lines.append(
                f"rollouts     {len(self.rollouts)} this start ({min(self.rollouts) + 1}-{last + 1}); "
                f"{last + 1} of {self.num_rollout} in all"
            )
        else:
            lines.append(f"rollouts     none this start ({done_before} of {self.num_rollout} done)")
        if self.rewards:
            (first_id, first), (last_id, last_reward) = self.rewards[0], self.rewards[-1]
            lines.append(f"reward       {first:.3f} -> {last_reward:.3f} (rollout {first_id + 1} -> {last_id + 1})")
        phases = [
            f"{label} {statistics.median(self.phase_seconds[key]):.2f}s"
            for label, key in PHASES
            if self.phase_seconds.get(key)
        ]
        if phases:
            lines.append("median time  " + " | ".join(phases))
        lines.append(f"checkpoint   {checkpoint or 'none written'}")
        lines.append(f"HF export    {hf_export or 'none written'}")
        lines.extend(f"{label:<12} {text}" for label, text in next_steps)
        return "\n".join(lines)
