"""Megatron distributed checkpoints of the trainer: every rank writes its own shards.

Inside one checkpoint directory (trainer/checkpoint.py makes it atomic: a `.tmp-` directory,
renamed, then the `complete` marker and `latest`):

    trainer/                 megatron.core.dist_checkpointing, torch_dist format: the model
                             shards, the optimizer's (distributed on GPU; torch AdamW on CPU,
                             sharded like the parameters it follows), the lr schedule and,
                             once refreshed (training.refUpdateInterval), the reference model
    trainer/rng/rank_<r>.pt  rank r's random generators (python, numpy, torch, CUDA, and
                             megatron's tensor-parallel RNG tracker)

torch_dist stores global tensors, so the model part loads at other tensor/pipeline sizes (`rlkube
convert megatron-to-hf` reads it at 1 x 1); the distributed optimizer's state is saved
`dp_reshardable`: a resume may change the data-parallel size, not the tensor or pipeline sizes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..rng import capture_rng_state, restore_rng_state

_DISTRIB_OPTIM = {"distrib_optim_sharding_type": "dp_reshardable"}


class TrainState(NamedTuple):
    """What a checkpoint holds of a megatron trainer rank: its GPTModel stage, its optimizer
    (megatron's distributed optimizer on GPU, torch AdamW on CPU: `cpu`) and the lr schedule;
    and, once `backend.ref_refreshed` (training.refUpdateInterval), its reference model's stage."""

    model: torch.nn.Module
    optimizer: Any
    schedule: Any
    cpu: bool
    backend: Any = None  # its ref_model and ref_refreshed


def save_trainer_state(parts: TrainState, directory: Path) -> None:
    """Collective: write the rank's model, optimizer, schedule and every rank's RNG into `directory`."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)  # empty: megatron warns about anything already there
    dist.barrier()
    state = _sharded_state(parts, is_loading=False, with_ref=_ref_refreshed(parts))
    dist_checkpointing.save(state, str(directory))
    (directory / "rng").mkdir(exist_ok=True)
    with open(directory / "rng" / f"rank_{dist.get_rank()}.pt", "wb") as f:
        torch.save(_rng_state(), f)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()


def load_trainer_state(parts: TrainState, directory: Path) -> None:
    """Collective: restore what `save_trainer_state` wrote."""
    from megatron.core import dist_checkpointing

    if not (directory / "metadata.json").is_file():
        raise FileNotFoundError(f"{directory} is not a megatron distributed checkpoint (no metadata.json)")
    with_ref = parts.backend is not None and parts.backend.ref_model is not None and bool(
        dist_checkpointing.load_common_state_dict(str(directory)).get(REF_REFRESHED))
    state = _sharded_state(parts, is_loading=True, with_ref=with_ref)
    loaded = dist_checkpointing.load(state, str(directory))
    load_model_state(parts.model, loaded["model"], directory)
    if with_ref:
        load_model_state(parts.backend.ref_model, _unprefixed(loaded[REF_MODEL], REF_MODEL), directory)
        parts.backend.ref_refreshed = True
    if parts.cpu:
        _load_torch_optimizer(parts, loaded["optimizer"])
    else:
        parts.optimizer.load_state_dict(loaded["optimizer"])
    parts.schedule.load_state_dict(loaded["scheduler"])
    rng_file = directory / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file():
        _restore_rng(torch.load(rng_file, map_location="cpu", weights_only=True))


def load_model_state(model: torch.nn.Module, state: dict, directory: Path) -> None:
    """Load `state` into `model`; every parameter must be there (megatron's `_extra_state`
    entries, empty for the local layer spec, may be absent)."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise KeyError(f"{directory} lacks model tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")


# The refreshed reference's shards are stored under their own key prefix beside the actor's, and
# the common state says they are there.
REF_MODEL, REF_REFRESHED = "ref_model", "ref_refreshed"


def _ref_refreshed(parts: TrainState) -> bool:
    return parts.backend is not None and parts.backend.ref_model is not None and parts.backend.ref_refreshed


def _unprefixed(state: dict, prefix: str) -> dict:
    return {key.removeprefix(f"{prefix}."): value for key, value in state.items()}


def _sharded_state(parts: TrainState, *, is_loading: bool, with_ref: bool = False) -> dict:
    model_state = parts.model.sharded_state_dict(prefix="")
    if parts.cpu:
        optim_state = _torch_optimizer_sharded(parts, model_state, is_loading=is_loading)
    else:
        if is_loading:
            # Without apex or TransformerEngine the distributed optimizer reads Adam's step from
            # torch's state, which a trainer resuming before its first step does not have yet.
            for inner in getattr(parts.optimizer, "chained_optimizers", [parts.optimizer]):
                _zero_adam_state(inner.optimizer)
        optim_state = parts.optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=_DISTRIB_OPTIM)
    state = {"model": model_state, "optimizer": optim_state, "scheduler": parts.schedule.state_dict()}
    if with_ref:
        state[REF_MODEL] = parts.backend.ref_model.sharded_state_dict(prefix=f"{REF_MODEL}.")
        state[REF_REFRESHED] = True
    return state


def _torch_optimizer_sharded(parts: TrainState, model_state: dict, *, is_loading: bool) -> dict:
    """torch AdamW's state as sharded tensors that follow the parameters' sharding (what
    megatron's FP32Optimizer does); its common step is kept as a plain value."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    optimizer = parts.optimizer
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if is_loading:
        _zero_adam_state(optimizer)
    state = optimizer.state_dict()
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"AdamW parameters are at different steps {sorted(steps)}; cannot checkpoint them as one")
    id_map = get_param_id_to_sharded_param_map(model_state, params)
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    state["common_step"] = steps.pop() if steps else 0.0
    return state


def _zero_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """The structure a checkpoint loads into: torch's Adam makes its state lazily at the first
    step, so parameters without one get step 0 and zero moments (the load overwrites them)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state.get(p):
                optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _load_torch_optimizer(parts: TrainState, loaded: dict) -> None:
    step = loaded.pop("common_step")
    for param_state in loaded["state"].values():
        param_state["step"] = torch.tensor(float(step))
    parts.optimizer.load_state_dict(loaded)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"process": capture_rng_state(), "tracker": dict(get_cuda_rng_tracker().get_states())}


def _restore_rng(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    restore_rng_state(state["process"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))
