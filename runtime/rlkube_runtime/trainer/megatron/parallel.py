"""megatron-core's process groups and random streams for a trainer rank, and moving tensors
between pipeline stages."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .model import ParallelSizes


def all_gather_stages(mine: dict[str, torch.Tensor], group, device: torch.device) -> dict[str, torch.Tensor]:
    """Every pipeline stage's tensors on every stage: names and shapes as objects, the tensors
    broadcast from their stage on the training device."""
    ranks = dist.get_process_group_ranks(group)
    merged: dict[str, torch.Tensor] = {}
    for src in ranks:
        meta = [[(k, tuple(v.shape), str(v.dtype)) for k, v in mine.items()] if dist.get_rank() == src else None]
        dist.broadcast_object_list(meta, src=src, group=group)
        for name, shape, _ in meta[0]:
            if dist.get_rank() == src:
                buf = mine[name].to(device)
            else:
                buf = torch.empty(shape, dtype=torch.float32, device=device)
            dist.broadcast(buf, src=src, group=group)
            merged[name] = buf.cpu()
    return merged


def init_parallel_state(sizes: ParallelSizes, *, cpu: bool) -> None:
    """torch.distributed (a private one-rank group when not initialised) and megatron's
    tensor/pipeline/data groups; re-made when an earlier backend in this process used other sizes."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        dist.init_process_group("gloo" if cpu else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (sizes.tensor * sizes.pipeline * sizes.context):
        raise ValueError(
            f"spec.parallelism: tensor x pipeline x context = {sizes.tensor * sizes.pipeline * sizes.context} "
            f"does not divide the {world} trainer ranks"
        )
    if world % (sizes.expert * sizes.etp * sizes.pipeline):
        raise ValueError(
            f"spec.parallelism.expert: expert x {'expertTensor' if sizes.expert_tensor else 'tensor'} x pipeline = "
            f"{sizes.expert * sizes.etp * sizes.pipeline} "
            f"does not divide the {world} trainer ranks"
        )
    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()) == (
            sizes.tensor, sizes.pipeline, sizes.expert, sizes.etp)
        if same:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        context_parallel_size=sizes.context,
        expert_model_parallel_size=sizes.expert,
        expert_tensor_parallel_size=sizes.expert_tensor,
    )


def seed_model_parallel(seed: int, *, cpu: bool) -> None:
    if cpu:
        from .cpu import seed_cpu_rng_tracker

        seed_cpu_rng_tracker(seed)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
