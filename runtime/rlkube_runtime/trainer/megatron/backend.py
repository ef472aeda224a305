"""The Megatron-core trainer backend: a GPTModel built from the HF config, split by tensor and
pipeline parallelism, trained with the same losses and micro-batches as the torch backend.

One instance per trainer rank. Data parallelism is what is left of the world after tensor x
pipeline; each data-parallel rank takes its token-balanced share (`partition_for_ranks`) and
plans micro-batches with `plan_micro_batches`, exactly as TorchBackend does. Micro-batches are
right-padded rows with a causal mask, run through megatron-core's forward/backward schedule
(1F1B when pipelined).

Loss scaling: `policy_objective` divides by the global sample/token counts, so the global loss
is the plain sum of micro-batch losses over all ranks. The schedule divides each micro-batch's
loss by the number of micro-batches and megatron's DDP averages over data-parallel ranks, so
each micro-batch's loss is multiplied back by both before the backward.

Two ways to train, chosen by the device:
- GPU: megatron-core DistributedDataParallel with the distributed optimizer (fp32 master weights
  sharded over data-parallel ranks), bf16 (or fp16) compute, megatron's grad-norm clipping.
- CPU (tests, CI, tiny runs): megatron-core's DDP and distributed optimizer allocate their buffers
  on CUDA, so the CPU path keeps fp32 parameters and steps torch AdamW (the torch backend's
  `_make_adamw`), summing gradients over data-parallel ranks and computing the norm over the
  tensor/pipeline shards itself. The model, the schedule and the checkpoint format are the same.

Weights leave as HF-named tensors (`export_weights`, gathered over tensor and pipeline ranks)
and checkpoints are megatron distributed checkpoints (checkpoint.py in this package).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from ...algorithms.entropy import log_probs_and_entropy
from ...algorithms.loss import policy_objective
from ..backend import LogProbs, joined_over_ranks, pick_model, step_metrics, summed_over_ranks
from ..batch import TrainBatch, loss_counts
from ..config import TrainerConfig
from ..lr_schedule import LRSchedule
from ..torch_backend import compile_enabled
from ..packing import pad_rows, partition_for_ranks, plan_micro_batches
from . import convert
from .cpu import in_cpu_mode
from .model import HFArchitecture, ParallelSizes, build_gpt_model, hf_architecture, split_megatron_args, transformer_config
from .weights import read_hf_tensors

log = logging.getLogger(__name__)

# A checkpoint's megatron part: this sub-directory of the checkpoint's directory.
CHECKPOINT_DIR = "trainer"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Megatron clips only when clip_grad > 0, and reports a norm only when it clips: "off" is a
# threshold no norm reaches, so the norm is still reported as the torch backend does.
_NO_CLIP = 1e30


class MegatronBackend:
    """`TrainerBackend` on megatron-core.

    sizes: tensor/pipeline/context parallel sizes, sequence parallelism and recompute
    (spec.parallelism). megatron_args: spec.model.megatronArgs. device: "cpu", or None for the
    current CUDA device. torch.distributed must be initialised when the world has more than one
    rank; with one rank a private single-process group is made.
    """

    def __init__(
        self,
        config: TrainerConfig,
        sizes: ParallelSizes | None = None,
        *,
        megatron_args: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.config = config
        self.sizes = sizes or ParallelSizes()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.cpu = self.device.type == "cpu"
        # On a GPU the log-prob/entropy chunks run compiled, as in the torch backend (RLKUBE_TORCH_COMPILE=0: eager).
        self._compiled = not self.cpu and compile_enabled()
        self.dtype = torch.float32 if self.cpu else _DTYPES[config.model.dtype]
        self._model_over, self._optim_over = split_megatron_args(megatron_args or {})
        if self.cpu and self._optim_over:
            key = next(k for k in megatron_args or {} if k.lstrip("-").replace("-", "_") in self._optim_over)
            raise ValueError(
                f"spec.model.megatronArgs.{key}: an optimizer setting of megatron's distributed optimizer, which runs "
                "on GPUs only; a CPU trainer steps torch AdamW"
            )

        self._construct(config)

    @in_cpu_mode
    def _construct(self, config: TrainerConfig) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        model_over = self._model_over
        hf_config = AutoConfig.from_pretrained(config.model.hf_checkpoint, trust_remote_code=config.model.trust_remote_code)
        self.arch: HFArchitecture = hf_architecture(hf_config)
        self.tconfig = transformer_config(self.arch, self.sizes, dtype=self.dtype, cpu=self.cpu, overrides=model_over)

        _init_parallel_state(self.sizes, cpu=self.cpu)
        self.rank = dist.get_rank()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        if self.cpu and self.pp_size > 1:
            raise ValueError(
                "spec.parallelism.pipeline: > 1 needs GPUs (megatron-core's pipeline schedule allocates on CUDA); "
                "use 1 on a CPU trainer"
            )
        torch.manual_seed(config.seed)
        _seed_model_parallel(config.seed, cpu=self.cpu)

        self._positions: tuple[torch.Tensor, torch.Tensor] | None = None  # see _only_response_positions
        self.model = self._build(config.model.hf_checkpoint)  # the GPTModel (this rank's shard)
        self.ref_model = None
        if config.loss.needs_ref_model:
            self.ref_model = self._build(config.model.ref_load or config.model.hf_checkpoint)
            self.ref_model.requires_grad_(False).eval()
            self.ref_module = self._half(self.ref_model)
        self.train_module = self._half(self.model)  # what the schedule runs (DDP on GPU)
        if self.cpu:
            from ..torch_backend import _make_adamw

            self.optimizer = _make_adamw(self.model, config)
        else:
            self.train_module, self.optimizer = self._gpu_ddp_and_optimizer(self.train_module)
        self.schedule = LRSchedule(self.optimizer, config.optimizer)
        self._released = False
        self._weights_offloaded = False  # GPU: the DDP weights buffer sits in host memory

    # -- forward passes -------------------------------------------------------------------

    @in_cpu_mode
    @torch.no_grad()
    def compute_log_probs(
        self, batch: TrainBatch, *, model: Literal["actor", "ref"] = "actor", with_entropy: bool = False
    ) -> LogProbs:
        self._check_resident("compute_log_probs")
        module = pick_model(model, self.train_module, self.ref_module if self.ref_model is not None else None)
        mine = partition_for_ranks(batch.total_lengths, self.dp_size)[self.dp_rank]
        local = batch.select(mine)
        plan = self._plan(local)
        micro = [self._micro_batch(local, group, [mine[i] for i in group]) for group in plan]
        was_training = module.training
        module.eval()
        outputs = self._run(module, micro, forward_only=True,
                            loss=partial(self._collect, with_entropy=with_entropy)) if micro else []
        module.train(was_training)
        results: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for out in outputs:
            for i, lp, ent in zip(out["index"], out["log_probs"], out["entropy"]):
                results[i] = (lp, ent)
        results = joined_over_ranks(results if self._reports else {})
        return LogProbs.in_batch_order(results, len(batch), with_entropy=with_entropy)

    def train_step(
        self,
        batch: TrainBatch,
        *,
        global_num_samples: int | None = None,
        global_num_tokens: int | None = None,
    ) -> dict[str, float]:
        metrics = self.accumulate_gradients(
            batch, global_num_samples=global_num_samples, global_num_tokens=global_num_tokens
        )
        lr = self.schedule.apply()
        if self.cpu:
            grad_norm = self._cpu_clip_and_step()
        elif not self._gpu_grads_finite():
            # bf16 has no loss scaler to catch this, and megatron would step on NaN; the torch
            # backend skips such a step, and so does this one.
            log.warning("non-finite gradients; skipping this optimizer step")
            grad_norm = math.nan
            self._zero_grad()
        else:
            ok, norm, _ = self.optimizer.step()
            grad_norm = float(norm) if norm is not None else math.nan
            if not ok:
                log.warning("megatron optimizer skipped this step")
        self.schedule.advance()
        return step_metrics(metrics, grad_norm=grad_norm, lr=lr)

    @in_cpu_mode
    def accumulate_gradients(
        self,
        batch: TrainBatch,
        *,
        global_num_samples: int | None = None,
        global_num_tokens: int | None = None,
    ) -> dict[str, float]:
        """The gradient of the global-batch loss in every parameter's grad (main_grad on GPU);
        no step. Returns the loss metrics summed over micro-batches and ranks."""
        self._check_resident("train_step")
        counts = loss_counts(
            batch, self.config.loss, global_num_samples=global_num_samples, global_num_tokens=global_num_tokens
        )

        mine = partition_for_ranks(batch.total_lengths, self.dp_size)[self.dp_rank]
        local = batch.select(mine)
        plan = self._plan(local)
        micro = [self._micro_batch(local, group, [mine[i] for i in group]) for group in plan]
        if not micro:  # this data-parallel rank has no share: a zero-weight pass keeps collectives paired
            micro = [self._micro_batch(batch, [0], [0], weight=0.0)]
        self.train_module.train()
        self._zero_grad()
        outputs = self._run(self.train_module, micro, forward_only=False,
                            loss=partial(self._objective, counts=counts, num_micro=len(micro)))
        if self.cpu:
            self._cpu_reduce_grads()
        sums: dict[str, float] = {}
        for out in outputs:
            for key, value in out.items():
                sums[key] = sums.get(key, 0.0) + value
        return {**summed_over_ranks(sums if self._reports else {}), "num_micro_batches": float(len(plan))}

    # -- weights out ----------------------------------------------------------------------

    @in_cpu_mode
    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named float32 CPU tensors of the whole model. Collective: every rank of the world
        calls it and every rank receives the whole model (gathered over tensor and pipeline ranks).
        Works while the memory is released too (the weights come back to the GPU meanwhile)."""
        with self._weights_resident():
            return self._export_weights()

    def _export_weights(self) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state as ps

        offset = self._layer_offset(self.model)
        mine: dict[str, torch.Tensor] = {}
        for name, tensor in _named_weights(self.model):
            if name == "output_layer.weight" and self.arch.tie_word_embeddings:
                continue  # a copy of the word embeddings on the last stage
            full = self._gather_tp(name, tensor.detach())
            mine[convert.to_global_layer(name, offset)] = full.to("cpu", torch.float32, copy=True)
        if self.pp_size > 1:
            mine = _all_gather_stages(mine, ps.get_pipeline_model_parallel_group(), self.device)
        return convert.megatron_to_hf(mine, self.arch)

    def save_hf(self, directory: str | Path) -> Path:
        """Export (collective) and write the HF directory on global rank 0."""
        weights = self.export_weights()
        if self.rank == 0:
            write_hf_directory(weights, directory, self.config.model.hf_checkpoint,
                               trust_remote_code=self.config.model.trust_remote_code,
                               tied=self.arch.tie_word_embeddings)
        return Path(directory)

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "the megatron backend saves distributed checkpoints from every rank: use save_distributed(dir)"
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("the megatron backend loads distributed checkpoints: use load_distributed(dir)")

    # In a checkpoint directory: every rank's shards under CHECKPOINT_DIR (checkpoint.py).
    checkpoint_format: str | None = "megatron_dist"

    def save(self, directory: str | Path) -> None:
        """Collective: this rank's part of the checkpoint in `directory`."""
        self.save_distributed(Path(directory) / CHECKPOINT_DIR)

    def load(self, directory: str | Path) -> None:
        """Collective: restore what `save` wrote."""
        self.load_distributed(Path(directory) / CHECKPOINT_DIR)

    @in_cpu_mode
    def save_distributed(self, directory: str | Path) -> None:
        """Collective: every rank writes its shards of model and optimizer, and its RNG streams."""
        from .checkpoint import save_trainer_state

        with self._resident():
            save_trainer_state(self, Path(directory))

    @in_cpu_mode
    def load_distributed(self, directory: str | Path) -> None:
        """Collective: restore what save_distributed wrote; the next train_step is identical."""
        from .checkpoint import load_trainer_state

        with self._resident():
            load_trainer_state(self, Path(directory))

    @contextlib.contextmanager
    def _resident(self):
        """Everything back on the device for the duration, then released again as it was."""
        released, weights_kept = self._released, not self._weights_offloaded
        self.resume_memory()
        try:
            yield
        finally:
            if released:
                self.release_memory(keep_weights=weights_kept)

    # -- colocated placement --------------------------------------------------------------

    def release_memory(self, *, keep_weights: bool = False) -> None:
        """Give the GPU back: gradient buffers freed, the weights buffer (unless `keep_weights`)
        and the reference model copied to pinned host memory, the distributed optimizer's
        fp32 shards and moments moved to the host, the CUDA cache emptied. megatron-core's
        buffer offload keeps every parameter a view of its buffer, so nothing is re-wired on
        resume. On CPU only the gradients go. Forward passes raise until `resume_memory`."""
        if not self._released:  # released already (the weights kept): the gradient buffers are gone
            self._zero_grad()
        if not self.cpu:
            torch.cuda.synchronize(self.device)
            for buffer in self._ddp_buffers():
                buffer.offload_to_cpu(move_params=not keep_weights, move_grads=True)
            self._weights_offloaded = self._weights_offloaded or not keep_weights
            self.optimizer.offload_to_cpu()
            if self.ref_model is not None:
                for p in self.ref_model.parameters():
                    p.data = p.data.to("cpu")
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self._released = True

    def resume_memory(self) -> None:
        if not self._released:
            return
        if not self.cpu:
            for buffer in self._ddp_buffers():
                buffer.reload_from_cpu(move_params=True, move_grads=True)
            self._weights_offloaded = False
            self.optimizer.restore_from_cpu()
            if self.ref_model is not None:
                for p in self.ref_model.parameters():
                    p.data = p.data.to(self.device)
            torch.cuda.synchronize(self.device)
        self._released = False

    @contextlib.contextmanager
    def _weights_resident(self):
        """The weights on the GPU for the duration (they were offloaded by release_memory)."""
        if self.cpu or not self._weights_offloaded:
            yield
            return
        for buffer in self._ddp_buffers():
            buffer.reload_from_cpu(move_params=True, move_grads=False)
        try:
            yield
        finally:
            for buffer in self._ddp_buffers():
                buffer.offload_to_cpu(move_params=True, move_grads=False)
            torch.cuda.empty_cache()

    def _ddp_buffers(self) -> list:
        return list(self.train_module.buffers) + list(getattr(self.train_module, "expert_parallel_buffers", []))

    @property
    def memory_released(self) -> bool:
        return self._released

    # -- building -------------------------------------------------------------------------

    def _build(self, hf_dir: str) -> torch.nn.Module:
        model = build_gpt_model(self.tconfig, self.arch, pre_process=self.first_stage, post_process=self.last_stage)
        load_hf_into(model, hf_dir, self.arch, tp_rank=self.tp_rank, tp_size=self.tp_size)
        if self.last_stage and not self.sizes.sequence_parallel:
            model.output_layer.register_forward_pre_hook(self._only_response_positions, with_kwargs=True)
        if not self.cpu:
            model.cuda(self.device)
        return model

    def _half(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.dtype == torch.float32:
            return model
        from megatron.core.transformer.module import Float16Module

        return Float16Module(self.tconfig, model)

    def _gpu_ddp_and_optimizer(self, module: torch.nn.Module):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallel(
            config=self.tconfig,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
                check_for_nan_in_grad=False,
            ),
            module=module,
        )
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.no_sync_func = ddp.no_sync
        opt = self.config.optimizer
        fields = dict(
            optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
            adam_beta1=opt.beta1, adam_beta2=opt.beta2, adam_eps=opt.eps,
            clip_grad=opt.clip_grad if opt.clip_grad > 0 else _NO_CLIP,
            bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16, params_dtype=self.dtype,
            use_distributed_optimizer=True,
        )
        fields.update(self._optim_over)
        optimizer = get_megatron_optimizer(OptimizerConfig(**fields), [ddp])
        # Megatron's own scheduler applies wd_mult (0 for biases and norms); rlkube's LRSchedule
        # only sets lr, so the per-group weight decay is fixed here once.
        for group in optimizer.param_groups:
            group["weight_decay"] = opt.weight_decay * group.get("wd_mult", 1.0)
        return ddp, optimizer

    # -- one schedule run -----------------------------------------------------------------

    def _run(self, module: torch.nn.Module, micro: list[dict[str, Any]], *, forward_only: bool, loss) -> list[Any]:
        """Forward (and backward) every micro-batch; returns what `loss` reported for each.

        Pipelined: megatron-core's 1F1B schedule. Otherwise the same steps in a plain loop (the
        schedule's no-pipelining variant allocates on CUDA, and this loop also runs on CPU):
        the loss divided by the micro-batch count, as the schedule does, gradients synchronised
        after the last micro-batch.
        """
        if self.pp_size == 1:
            reported = []
            for k, mb in enumerate(micro):
                sync = k == len(micro) - 1 or forward_only
                with contextlib.nullcontext() if sync or self.cpu else module.no_sync():
                    output = self._forward(module, mb)
                    value, report = loss(mb, output)
                    if not forward_only:
                        (value / len(micro)).backward()
                reported.append(report)
            if not forward_only and self.tconfig.finalize_model_grads_func is not None:
                self.tconfig.finalize_model_grads_func([module])
            return reported

        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return self._forward(model, mb), partial(loss, mb)

        first = micro[0]["input_ids"]
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[module],
            num_microbatches=len(micro),
            seq_length=first.shape[1],
            micro_batch_size=first.shape[0],
            forward_only=forward_only,
        )

    def _forward(self, module: torch.nn.Module, mb: dict[str, Any]) -> torch.Tensor:
        self._positions = (mb["rows"], mb["cols"])
        try:
            return module(mb["input_ids"], mb["position_ids"], mb["attention_mask"])
        finally:
            self._positions = None

    def _micro_batch(self, batch: TrainBatch, group: list[int], index: list[int], *, weight: float = 1.0) -> dict[str, Any]:
        """One micro-batch as model inputs: right-padded rows (length rounded up to a multiple
        of the tensor-parallel size for sequence parallelism), the causal mask, and where each
        sample's response logits and targets are."""
        mb = batch.select(group)
        rows = pad_rows(mb.tokens)
        rows_idx, cols_idx = rows.response_index(mb.response_lengths)
        length = rows.input_ids.shape[1]
        padded = -(-length // self.tp_size) * self.tp_size if self.sizes.sequence_parallel else length
        ids = torch.nn.functional.pad(rows.input_ids, (0, padded - length))
        return {
            "input_ids": ids.to(self.device),
            "position_ids": torch.arange(padded).expand_as(ids).to(self.device),
            "attention_mask": torch.triu(torch.ones(padded, padded, dtype=torch.bool), 1)[None, None].to(self.device),
            "rows": rows_idx.to(self.device),
            "cols": cols_idx.to(self.device),
            "targets": rows.input_ids[rows_idx, cols_idx + 1].to(self.device),
            "response_lengths": list(mb.response_lengths),
            "index": index,
            "batch": mb,
            "weight": weight,
        }

    def _only_response_positions(self, module, args, kwargs):
        """Forward pre-hook of the LM head: while a micro-batch runs, hand it the hidden states
        of the response positions only ([s, b, h] -> [ΣR, 1, h]), as the torch backend's
        ResponseLogits does, so the [b, s, vocab] logits are never built. Not with sequence
        parallelism, where the head's input is still split over the sequence."""
        if self._positions is None:
            return None
        rows, cols = self._positions
        hidden = args[0][cols, rows].unsqueeze(1)
        return (hidden, *args[1:]), kwargs

    def _response_logits(self, mb: dict[str, Any], logits: torch.Tensor) -> torch.Tensor:
        """[ΣR, V] logits at the response positions, gathered over tensor-parallel ranks."""
        if self.last_stage and not self.sizes.sequence_parallel:
            picked = logits[0]  # the LM head saw the response positions only: [1, ΣR, V/tp]
        else:
            picked = logits[mb["rows"], mb["cols"]]
        if self.tp_size > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            picked = gather_from_tensor_model_parallel_region(picked)
        return picked

    def _collect(self, mb: dict[str, Any], logits: torch.Tensor, *, with_entropy: bool):
        z = self._response_logits(mb, logits)
        t = self.config.temperature
        split = mb["response_lengths"]
        logp, ent = log_probs_and_entropy(
            z, mb["targets"], t, with_entropy=with_entropy, entropy_grad=False, compiled=self._compiled
        )
        logp = logp.float().cpu().split(split)
        ent = ent.float().cpu().split(split) if with_entropy else [None] * len(split)
        return logits.new_zeros(()), {"index": mb["index"], "log_probs": list(logp), "entropy": list(ent)}

    def _objective(self, mb: dict[str, Any], logits: torch.Tensor, *, counts: tuple[int, int], num_micro: int):
        loss_cfg = self.config.loss
        z = self._response_logits(mb, logits)
        t = self.config.temperature
        split = mb["response_lengths"]
        logp, ent = log_probs_and_entropy(
            z, mb["targets"], t, entropy_grad=loss_cfg.entropy_coef != 0, compiled=self._compiled
        )
        logp, ent = list(logp.split(split)), list(ent.split(split))
        b: TrainBatch = mb["batch"]
        loss, metrics = policy_objective(
            log_probs=logp,
            old_log_probs=self._to_device(b.old_log_probs),
            advantages=self._to_device(b.advantages),
            loss_masks=self._to_device(b.loss_masks),
            entropy=ent,
            ref_log_probs=self._to_device(b.ref_log_probs),
            rollout_log_probs=self._to_device(b.rollout_log_probs),
            global_num_samples=counts[0],
            global_num_tokens=counts[1],
            config=loss_cfg,
        )
        weight = mb["weight"]
        # The schedule divides by the micro-batch count; DDP (GPU) averages over data-parallel ranks.
        scale = num_micro * (1 if self.cpu else self.dp_size) * weight
        return loss * scale, {k: float(v) * weight for k, v in metrics.items()}

    # -- gradients on the CPU path ---------------------------------------------------------

    def _zero_grad(self) -> None:
        if self.cpu:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.train_module.zero_grad_buffer()
            self.optimizer.zero_grad()

    def _cpu_reduce_grads(self) -> None:
        """What megatron's finalize_model_grads does on GPU: sum gradients over data-parallel
        ranks, over tensor-parallel ranks for sequence-parallel and q/k norms, and between the
        first and last pipeline stage for tied embeddings."""
        from megatron.core import parallel_state as ps

        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp_size > 1:
            for p in params:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        if self.tp_size > 1:
            # Norm weights whose inputs are split over tensor-parallel ranks (the sequence with
            # sequence parallelism; the heads for q/k norms) get a partial gradient on each rank.
            tp_group = ps.get_tensor_model_parallel_group()
            for name, p in self.model.named_parameters():
                if not p.requires_grad:
                    continue
                if getattr(p, "average_gradients_across_tp_domain", False):
                    dist.all_reduce(p.grad, group=tp_group)
                    p.grad.div_(self.tp_size)
                elif (self.sizes.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                    self.arch.qk_norm and ("q_layernorm" in name or "k_layernorm" in name)
                ):
                    dist.all_reduce(p.grad, group=tp_group)
        if self.pp_size > 1 and self.arch.tie_word_embeddings:
            shared = self.model.shared_embedding_or_output_weight()
            if shared is not None:
                dist.all_reduce(shared.grad, group=ps.get_embedding_group())

    def _gpu_grads_finite(self) -> bool:
        """Whether every rank's gradient buffers are finite (one reduction per buffer, one all-reduce)."""
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for buffer in self._ddp_buffers():
            if buffer.grad_data is not None and buffer.grad_data.numel():
                bad = torch.maximum(bad, (~torch.isfinite(buffer.grad_data)).any().float())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def _cpu_clip_and_step(self) -> float:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        squares = torch.zeros((), dtype=torch.float64)
        params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        for p in params:
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.double().pow(2).sum()
        dist.all_reduce(squares, group=ps.get_model_parallel_group())
        norm = float(squares.sqrt())
        clip = self.config.optimizer.clip_grad
        if clip > 0 and math.isfinite(norm) and norm > clip:
            for p in params:
                p.grad.mul_(clip / (norm + 1e-6))
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            log.warning("gradient norm is %s; skipping this optimizer step", norm)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # -- helpers --------------------------------------------------------------------------

    def _plan(self, batch: TrainBatch) -> list[list[int]]:
        b = self.config.batching
        return plan_micro_batches(
            batch.total_lengths,
            dynamic_batch_size=b.dynamic_batch_size,
            max_tokens_per_gpu=b.max_tokens_per_gpu,
            micro_batch_size=b.micro_batch_size,
        )

    @property
    def _reports(self) -> bool:
        """Whether this rank's per-sample results and loss sums are the ones every rank receives:
        the last pipeline stage computes them, and its tensor-parallel ranks all hold the same."""
        return self.last_stage and self.tp_rank == 0

    def _gather_tp(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or not convert.is_tp_sharded(name):
            return tensor
        from megatron.core import parallel_state as ps

        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
        return convert.tp_merge(name, parts)

    @staticmethod
    def _layer_offset(model: torch.nn.Module) -> int:
        layers = model.decoder.layers
        return layers[0].layer_number - 1 if len(layers) else 0

    def _to_device(self, tensors: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        return None if tensors is None else [t.to(self.device, non_blocking=True) for t in tensors]

    def _check_resident(self, what: str) -> None:
        if self._released:
            raise RuntimeError(f"{what} called while the trainer's memory is released; call resume_memory() first")


def load_hf_into(model: torch.nn.Module, hf_dir: str | Path, arch: HFArchitecture, *, tp_rank: int, tp_size: int) -> None:
    """Copy this tensor/pipeline rank's share of the HF checkpoint in `hf_dir` into `model`."""
    offset = MegatronBackend._layer_offset(model)
    hf = read_hf_tensors(hf_dir)
    full = convert.hf_to_megatron(hf, arch)
    with torch.no_grad():
        for name, param in _named_weights(model):
            key = convert.to_global_layer(name, offset)
            if key == "output_layer.weight" and arch.tie_word_embeddings:
                key = "embedding.word_embeddings.weight"  # the last stage's copy of the embeddings
            if key not in full:
                raise KeyError(f"no HF tensor converts to megatron parameter {key!r}")
            part = convert.tp_split(key, full[key], tp_rank, tp_size)
            if tuple(part.shape) != tuple(param.shape):
                raise ValueError(f"{key}: converted shape {tuple(part.shape)} != model shape {tuple(param.shape)}")
            param.copy_(part)
            _mark_tensor_parallel(param, convert.tp_partition_dim(key))


def _mark_tensor_parallel(param: torch.Tensor, dim: int | None) -> None:
    """The attributes megatron-core's grad-norm and optimizer read to tell shards from copies.
    Its layers set them only while initialising weights, which loading replaces
    (perform_initialization=False)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if dim is not None and not getattr(param, "tensor_model_parallel", False):
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(param, attr):
                delattr(param, attr)
        set_tensor_model_parallel_attributes(param, True, dim, 1)


def write_hf_directory(weights: dict[str, torch.Tensor], directory: str | Path, source: str, *,
                       trust_remote_code: bool, tied: bool) -> Path:
    """config.json (and generation config), model.safetensors and the tokenizer of `source`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code).save_pretrained(directory)
    generation = Path(source) / "generation_config.json"
    if generation.is_file():
        (directory / "generation_config.json").write_bytes(generation.read_bytes())
    tensors = {k: v.contiguous() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    try:
        AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code).save_pretrained(directory)
    except (OSError, ValueError) as err:
        raise RuntimeError(f"could not copy the tokenizer of {source!r} into {directory}: {err}") from err
    return directory


def _named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters of a GPTModel stage by state-dict name (no `_extra_state`, no buffers)."""
    return [(k, v) for k, v in model.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state") and isinstance(v, torch.Tensor) and "rotary_pos_emb" not in k]


def _all_gather_stages(mine: dict[str, torch.Tensor], group, device: torch.device) -> dict[str, torch.Tensor]:
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


def _init_parallel_state(sizes: ParallelSizes, *, cpu: bool) -> None:
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
    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) == (
            sizes.tensor, sizes.pipeline)
        if same:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        context_parallel_size=sizes.context,
    )


def _seed_model_parallel(seed: int, *, cpu: bool) -> None:
    if cpu:
        from .cpu import seed_cpu_rng_tracker

        seed_cpu_rng_tracker(seed)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
