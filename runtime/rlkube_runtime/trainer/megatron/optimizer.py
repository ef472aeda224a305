"""Gradients and the optimizer step of a megatron trainer rank, the two ways it trains.

GPU: megatron-core's DistributedDataParallel with the distributed optimizer (fp32 master weights
sharded over data-parallel ranks); megatron reduces the gradients and clips them. CPU: megatron's
DDP and optimizer allocate on CUDA, so the gradients are reduced here (what finalize_model_grads
does), the norm is taken over the tensor/pipeline shards, and torch AdamW steps
(trainer/optim.py, as the torch backend does).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config import OptimizerConfig
from ..optim import step_if_finite
from .experts import is_expert_parallel

# Megatron clips only when clip_grad > 0, and reports a norm only when it clips: "off" is a
# threshold no norm reaches, so the norm is still reported as the torch backend does.
_NO_CLIP = 1e30


def gpu_ddp_and_optimizer(module: torch.nn.Module, tconfig, opt: OptimizerConfig, *, dtype: torch.dtype,
                          overrides: dict):
    """(megatron DDP around `module`, the distributed optimizer); `overrides`: the optimizer's
    fields from spec.model.megatronArgs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    ddp = DistributedDataParallel(
        config=tconfig,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
            check_for_nan_in_grad=False,
        ),
        module=module,
    )
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = ddp.no_sync
    fields = dict(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.beta1, adam_beta2=opt.beta2, adam_eps=opt.eps,
        clip_grad=opt.clip_grad if opt.clip_grad > 0 else _NO_CLIP,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=True,
    )
    fields.update(overrides)
    optimizer = get_megatron_optimizer(MegatronOptimizerConfig(**fields), [ddp])
    # Megatron's own scheduler applies wd_mult (0 for biases and norms); rlkube's LRSchedule
    # only sets lr, so the per-group weight decay is fixed here once.
    for group in optimizer.param_groups:
        group["weight_decay"] = opt.weight_decay * group.get("wd_mult", 1.0)
    return ddp, optimizer


def gpu_grads_finite(buffers: list, device: torch.device) -> bool:
    """Whether every rank's gradient buffers are finite (one reduction per buffer, one all-reduce)."""
    bad = torch.zeros((), dtype=torch.float32, device=device)
    for buffer in buffers:
        if buffer.grad_data is not None and buffer.grad_data.numel():
            bad = torch.maximum(bad, (~torch.isfinite(buffer.grad_data)).any().float())
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())


def cpu_reduce_grads(model: torch.nn.Module, *, sizes, arch, dp_size: int, tp_size: int, pp_size: int) -> None:
    """What megatron's finalize_model_grads does on GPU: sum gradients over data-parallel
    ranks (an expert's over expert-data-parallel ranks), over tensor-parallel ranks for sequence-parallel and q/k norms, and between the
    first and last pipeline stage for tied embeddings."""
    from megatron.core import parallel_state as ps

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if dp_size > 1:
        for p in params:
            if not is_expert_parallel(p):  # an expert's gradient already has every exchanging rank's tokens
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
    expert_dp = ps.get_expert_data_parallel_group()
    if dist.get_world_size(expert_dp) > 1:
        for p in params:
            if is_expert_parallel(p):
                dist.all_reduce(p.grad, group=expert_dp)
    if tp_size > 1:
        # Norm weights whose inputs are split over tensor-parallel ranks (the sequence with
        # sequence parallelism; the heads for q/k norms) get a partial gradient on each rank.
        tp_group = ps.get_tensor_model_parallel_group()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if getattr(p, "average_gradients_across_tp_domain", False):
                dist.all_reduce(p.grad, group=tp_group)
                p.grad.div_(tp_size)
            elif (sizes.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                arch.qk_norm and ("q_layernorm" in name or "k_layernorm" in name)
            ):
                dist.all_reduce(p.grad, group=tp_group)
    if pp_size > 1 and arch.tie_word_embeddings:
        shared = model.shared_embedding_or_output_weight()
        if shared is not None:
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())


def cpu_clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, clip: float) -> float:
    """The gradient norm over every shard once (no tensor-parallel duplicates, no shared copies),
    clipping to `clip` (0: off), and the step when the norm is finite. Returns the norm."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    squares = torch.zeros((), dtype=torch.float64)
    expert_squares = torch.zeros((), dtype=torch.float64)  # distinct on each expert-parallel rank
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    for p in params:
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            (expert_squares if is_expert_parallel(p) else squares).add_(p.grad.double().pow(2).sum())
    dist.all_reduce(squares, group=ps.get_model_parallel_group())
    dist.all_reduce(expert_squares, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    norm = float((squares + expert_squares).sqrt())
    if clip > 0 and math.isfinite(norm) and norm > clip:
        for p in params:
            p.grad.mul_(clip / (norm + 1e-6))
    return step_if_finite(optimizer, norm)
