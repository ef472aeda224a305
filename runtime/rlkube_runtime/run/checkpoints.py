"""The job's checkpoints: the trainer's state (written by the ranks themselves, in their
backend's format), the data position and the progress, made visible at once; and the resume
from the newest complete one."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any


def save(job, rollout_id: int) -> dict[str, Any]:
    """A checkpoint of everything up to `rollout_id`: its rollout, path and time."""
    from rlkube_runtime.trainer.checkpoint import abandon_checkpoint, begin_checkpoint, finish_checkpoint

    root = job.plan.checkpoint_root
    # Every rank writes its part into the checkpoint's temporary directory; this process adds
    # the small parts and makes the whole directory visible at once.
    tmp = begin_checkpoint(root, rollout_id)
    try:
        trainer = job.trainers.save(tmp)
    except Exception as err:  # a full disk on a rank: the partial save goes, the cause is named
        raise abandon_checkpoint(root, rollout_id, tmp, getattr(err, "cause", None) or err) from err
    payload = {
        **trainer,
        # The data position as of the next rollout's start (in async mode rollout k+1 already
        # took its prompts; its checkpointed position is from before).
        "data_source": job.rollouts.data_state(rollout_id + 1),
        "progress": {"rollout_id": rollout_id, "num_rollout": job.spec.training.num_rollout},
    }
    path = finish_checkpoint(root, rollout_id, tmp, payload, keep=job.spec.checkpoint.keep)
    job.last_saved, job.last_saved_path = rollout_id, str(path)
    return {"rollout": rollout_id, "path": str(path), "time": datetime.now(timezone.utc)}


def resume(job) -> int:
    """Load the newest complete checkpoint, if any (trainer state, each rank's random streams,
    the data position), give the engines its weights; returns the first rollout to run."""
    from rlkube_runtime.trainer.checkpoint import load_latest_checkpoint

    found = None
    for root in job.plan.resume_roots:
        found = load_latest_checkpoint(root)
        if found is not None:
            break
    if found is None:
        return 0
    print(f"resuming from checkpoint {found.path} (rollout {found.rollout_id})", flush=True)
    job.trainers.load(found.path, found.payload)
    job.rollouts.load_data_state(found.payload["data_source"])
    start = found.rollout_id + 1
    job.last_saved, job.last_saved_path = found.rollout_id, str(found.path)
    job.trainers.push_weights(job.rollouts, start)
    return start
