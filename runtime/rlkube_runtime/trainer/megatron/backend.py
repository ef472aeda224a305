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
  on CUDA, so the CPU path keeps fp32 parameters and steps torch AdamW (trainer/optim.py, as the
  torch backend does), summing gradients over data-parallel ranks and computing the norm over the
  tensor/pipeline shards itself. The model, the schedule and the checkpoint format are the same.

Weights leave as HF-named tensors (gathered over tensor and pipeline ranks by `gather_for_push`
or `export_weights`; conversion in convert.py, HF files in weights.py) and checkpoints are
megatron distributed checkpoints (checkpoint.py in this package).
"""

from __future__ import annotations

import contextlib
import logging
import math
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from ...algorithms.entropy import log_probs_and_entropy
from ...memory import PinnedOffload
from ..backend import DTYPES, LogProbs, TrainerBackend, compile_enabled, joined_over_ranks, pick_model, summed_over_ranks
from ..batch import TrainBatch, loss_counts
from ..config import TrainerConfig
from ..lr_schedule import LRSchedule
from ..optim import make_adamw
from ..packing import partition_for_ranks
from . import checkpoint, convert, experts, optimizer
from .cpu import in_cpu_mode
from .micro_batch import model_inputs
from .model import HFArchitecture, ParallelSizes, build_gpt_model, hf_architecture, split_megatron_args, transformer_config
from .parallel import all_gather_stages, init_parallel_state, seed_model_parallel
from .routing_replay import RouteReplay, replay_targets
from .weights import layer_offset, load_hf_into, named_weights, write_hf_directory

log = logging.getLogger(__name__)

# A checkpoint's megatron part: this sub-directory of the checkpoint's directory.
CHECKPOINT_DIR = "trainer"


def _moe_loss_tracker_values() -> dict[str, torch.Tensor]:
    """A copy of megatron-core's per-layer sums of the MoE losses tracked so far this step."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: entry["values"].clone() for name, entry in get_moe_layer_wise_logging_tracker().items()}


def _restore_moe_loss_tracker(values: dict[str, torch.Tensor]) -> None:
    """Put back what `_moe_loss_tracker_values` copied (a loss tracked since then is dropped)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    for name, entry in get_moe_layer_wise_logging_tracker().items():
        if name in values:
            entry["values"].copy_(values[name])
        else:
            entry["values"].zero_()


@contextlib.contextmanager
def moe_losses_off():
    """While inside, megatron-core's schedule sets the MoE losses' gradient scale to 0 whatever it
    computes: passes that must not train the router through a load-balancing loss."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    own = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]
    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(lambda scale: own.__func__(torch.zeros_like(scale)))
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = own


class MegatronBackend(TrainerBackend):
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
        self.dtype = torch.float32 if self.cpu else DTYPES[config.model.dtype]
        self._model_over, self._optim_over = split_megatron_args(megatron_args or {})
        if self.cpu and self._optim_over:
            key = next(k for k in megatron_args or {} if k.lstrip("-").replace("-", "_") in self._optim_over)
            raise ValueError(
                f"spec.model.megatronArgs.{key}: an optimizer setting of megatron's distributed optimizer, which runs "
                "on GPUs only; a CPU trainer steps torch AdamW"
            )

        if config.lora is not None:
            from ...spec.lora import LORA_MEGATRON_MESSAGE

            raise ValueError(f"spec.training.lora: {LORA_MEGATRON_MESSAGE}")
        self._construct(config)

    @in_cpu_mode
    def _construct(self, config: TrainerConfig) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        model_over = self._model_over
        hf_config = AutoConfig.from_pretrained(config.model.hf_checkpoint, trust_remote_code=config.model.trust_remote_code)
        self.arch: HFArchitecture = hf_architecture(hf_config)
        self.tconfig = transformer_config(self.arch, self.sizes, dtype=self.dtype, cpu=self.cpu, overrides=model_over,
                                          routing_replay=config.routing_replay)
        if config.routing_replay and self.sizes.pipeline > 1:
            from ...spec.backend_rules import PIPELINE_ROUTING_REPLAY_MESSAGE

            raise ValueError(f"spec.training.routingReplay: {PIPELINE_ROUTING_REPLAY_MESSAGE % self.sizes.pipeline}")

        init_parallel_state(self.sizes, cpu=self.cpu)
        self.rank = dist.get_rank()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.ep_rank, self.experts_per_rank = ps.get_expert_model_parallel_rank(), self.arch.num_experts // self.sizes.expert
        self.etp_rank, self.etp_size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        if self.cpu and self.pp_size > 1:
            raise ValueError(
                "spec.parallelism.pipeline: > 1 needs GPUs (megatron-core's pipeline schedule allocates on CUDA); "
                "use 1 on a CPU trainer"
            )
        torch.manual_seed(config.seed)
        seed_model_parallel(config.seed, cpu=self.cpu)

        self._positions: tuple[torch.Tensor, torch.Tensor] | None = None  # see _only_response_positions
        self.model = self._build(config.model.hf_checkpoint)  # the GPTModel (this rank's shard)
        self._route_replay = RouteReplay(self.model) if config.routing_replay else None
        self.replayed_routes = (self.arch.num_layers, self.arch.moe_topk) if config.routing_replay else None
        self.ref_model = None
        if config.loss.needs_ref_model:
            self.ref_model = self._build(config.model.ref_load or config.model.hf_checkpoint)
            self.ref_model.requires_grad_(False).eval()
            self.ref_module = self._half(self.ref_model)
        self.train_module = self._half(self.model)  # what the schedule runs (DDP on GPU)
        if self.cpu:
            self.optimizer = make_adamw(self.model, config)
        else:
            self.train_module, self.optimizer = optimizer.gpu_ddp_and_optimizer(
                self.train_module, self.tconfig, config.optimizer, dtype=self.dtype, overrides=self._optim_over)
        self.schedule = LRSchedule(self.optimizer, config.optimizer)
        self._released = False
        self._weights_offloaded = False  # GPU: the DDP weights buffer sits in host memory
        self._offload = PinnedOffload()  # the optimizer's and the reference model's host twins
        self._gathered: dict[str, torch.Tensor] | None = None  # the whole model, for pushes (gather_for_push)

    # -- forward passes -------------------------------------------------------------------

    @in_cpu_mode
    @torch.no_grad()
    def log_probs(
        self, batch: TrainBatch, *, model: Literal["actor", "ref"] = "actor", with_entropy: bool = False
    ) -> LogProbs:
        self._check_resident("log_probs")
        module = pick_model(model, self.train_module, self.ref_module if self.ref_model is not None else None)
        micro, _ = self._rank_micro_batches(batch)
        was_training = module.training
        module.eval()
        outputs = self._run(module, micro, forward_only=True, replay=model == "actor",
                            loss=partial(self._collect, with_entropy=with_entropy)) if micro else []
        module.train(was_training)
        results: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for out in outputs:
            for i, lp, ent in zip(out["index"], out["log_probs"], out["entropy"]):
                results[i] = (lp, ent)
        results = joined_over_ranks(results if self._reports else {})
        return LogProbs.in_batch_order(results, len(batch), with_entropy=with_entropy)

    def clip_and_step(self) -> float:
        if self.cpu:
            return optimizer.cpu_clip_and_step(self.model, self.optimizer, self.config.optimizer.clip_grad)
        if not optimizer.gpu_grads_finite(self._ddp_buffers(), self.device):
            # bf16 has no loss scaler to catch this, and megatron would step on NaN; the torch
            # backend skips such a step, and so does this one.
            log.warning("non-finite gradients; skipping this optimizer step")
            self._zero_grad()
            return math.nan
        ok, norm, _ = self.optimizer.step()
        if not ok:
            log.warning("megatron optimizer skipped this step")
        return float(norm) if norm is not None else math.nan

    @in_cpu_mode
    def accumulate_gradients(
        self,
        batch: TrainBatch,
        *,
        global_num_samples: int | None = None,
        global_num_tokens: int | None = None,
    ) -> dict[str, float]:
        """The gradient of the global-batch loss in every parameter's grad (main_grad on GPU); no step."""
        self._check_resident("train_step")
        counts = loss_counts(
            batch, self.config.loss, global_num_samples=global_num_samples, global_num_tokens=global_num_tokens
        )

        micro, plan = self._rank_micro_batches(batch)
        if not micro:  # this data-parallel rank has no share: a zero-weight pass keeps collectives paired
            micro = [self._zero_weight_micro_batch(batch)]
        self.train_module.train()
        self._zero_grad()
        outputs = self._run(self.train_module, micro, forward_only=False, replay=True,
                            loss=partial(self._objective, counts=counts, num_micro=len(micro)))
        if self.cpu:
            optimizer.cpu_reduce_grads(self.model, sizes=self.sizes, arch=self.arch, dp_size=self.dp_size,
                                       tp_size=self.tp_size, pp_size=self.pp_size)
        sums: dict[str, float] = {}
        for out in outputs:
            for key, value in out.items():
                sums[key] = sums.get(key, 0.0) + value
        return {**summed_over_ranks(sums if self._reports else {}), **self._moe_loss_report(len(plan)),
                **self._replay_report(), "num_micro_batches": float(len(plan))}

    def _replay_report(self) -> dict[str, float]:
        """Under routing replay, `routing_replay_mismatch`: the share of the step's real (token,
        layer) routes where the trainer's routers would have picked other experts than the engine
        did. Collective; tensor-parallel ranks count their own tokens only under sequence parallelism."""
        if self._route_replay is None:
            return {}
        differ, routes = self._route_replay.counted()
        mine = self.tp_rank == 0 or self.sizes.sequence_parallel
        total = summed_over_ranks({"differ": differ, "routes": float(routes)} if mine else {})
        return {"routing_replay_mismatch": total.get("differ", 0.0) / max(total.get("routes", 0.0), 1.0)}

    def _moe_loss_report(self, real_micro_batches: int) -> dict[str, float]:
        """Each MoE load-balancing loss this step trained with (unscaled by its coefficient, as
        megatron-core tracks it: "moe_load_balancing_loss", "moe_z_loss"), the mean over layers
        and micro-batches, averaged over data-parallel ranks; each pipeline stage adds its
        layers. Collective when such a loss is on; empty otherwise."""
        if not self._moe_losses_on:
            return {}
        share: dict[str, float] = {}
        if self.tp_rank == 0 and real_micro_batches:  # tensor-parallel ranks track the same values
            for name, values in _moe_loss_tracker_values().items():
                share[f"moe_{name}"] = float(values.sum()) / (real_micro_batches * self.arch.num_layers * self.dp_size)
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        return summed_over_ranks(share)

    # -- weights out ----------------------------------------------------------------------

    @in_cpu_mode
    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named float32 CPU tensors of the whole model. Collective: every rank of the world
        calls it and every rank receives the whole model (gathered over tensor and pipeline ranks).
        Works while the memory is released too (the weights come back to the GPU meanwhile)."""
        with self._weights_resident():
            return self._export_weights()

    def _export_weights(self, *, on_device: bool = False) -> dict[str, torch.Tensor]:
        """HF-named tensors of the whole model: float32 host copies, or (`on_device`) the
        gathered tensors where they are, in the training dtype, views of the weights where one
        rank holds the whole of one."""
        from megatron.core import parallel_state as ps

        offset = layer_offset(self.model)
        mine: dict[str, torch.Tensor] = {}
        for name, tensor in named_weights(self.model):
            if name == "output_layer.weight" and self.arch.tie_word_embeddings:
                continue  # a copy of the word embeddings on the last stage
            full = self._gather_tp(name, tensor.detach())
            gathered = {name: full}
            if self.sizes.expert > 1 and convert.is_expert(name):
                gathered = experts.gather_expert(name, full, experts_per_rank=self.experts_per_rank,
                                                 group=ps.get_expert_model_parallel_group())
            for local_name, part in gathered.items():
                key = convert.to_global_layer(local_name, offset)
                mine[key] = part if on_device else part.to("cpu", torch.float32, copy=True)
        if self.pp_size > 1:
            mine = all_gather_stages(mine, ps.get_pipeline_model_parallel_group(), self.device)
        return convert.megatron_to_hf(mine, self.arch)

    def gather_for_push(self, keep: bool = True) -> None:
        """Collective: the whole model kept on the ranks that push (`keep`), for the pushes that
        follow, which run on those ranks alone. With the weights on the GPU and one pipeline
        stage, the tensors stay there in the training dtype (no host copy, no float32 upcast:
        the sender stages them on the GPU for the engines); `release` drops them."""
        if not self.cpu and self.pp_size == 1 and not self._weights_offloaded:
            weights = self._export_weights(on_device=True)
        else:
            weights = self.export_weights()
        self._gathered = weights if keep else None

    def weights_for_push(self):
        return iter(self._gathered_weights().items())

    def save_hf(self, directory: str | Path) -> Path:
        """The weights of the last `gather_for_push` as an HF directory; on one rank."""
        weights = {name: t.to("cpu", torch.float32) for name, t in self._gathered_weights().items()}
        return write_hf_directory(weights, directory, self.config.model.hf_checkpoint,
                                  trust_remote_code=self.config.model.trust_remote_code,
                                  tied=self.arch.tie_word_embeddings)

    def _gathered_weights(self) -> dict[str, torch.Tensor]:
        if self._gathered is None:
            raise RuntimeError("no gathered weights: the loop calls stage_weights (gather_for_push) on every "
                               "trainer rank before a push or an HF export")
        return self._gathered

    # -- checkpoints ----------------------------------------------------------------------

    # In a checkpoint directory: every rank's shards under CHECKPOINT_DIR (checkpoint.py).
    checkpoint_format: str | None = "megatron_dist"
    gathers_for_push = True  # tensor and pipeline ranks each hold a part of the model

    def save(self, directory: str | Path) -> None:
        """Collective: this rank's part of the checkpoint in `directory`."""
        self.save_distributed(Path(directory) / CHECKPOINT_DIR)

    def load(self, directory: str | Path) -> None:
        """Collective: restore what `save` wrote."""
        self.load_distributed(Path(directory) / CHECKPOINT_DIR)

    @in_cpu_mode
    def save_distributed(self, directory: str | Path) -> None:
        """Collective: every rank writes its shards of model and optimizer, and its RNG streams."""
        with self._resident():
            checkpoint.save_trainer_state(self._train_state(), Path(directory))

    @in_cpu_mode
    def load_distributed(self, directory: str | Path) -> None:
        """Collective: restore what save_distributed wrote; the next train_step is identical."""
        with self._resident():
            checkpoint.load_trainer_state(self._train_state(), Path(directory))

    def _train_state(self) -> checkpoint.TrainState:
        return checkpoint.TrainState(self.model, self.optimizer, self.schedule, cpu=self.cpu, backend=self)

    def actor_and_reference(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        return self.model, self.ref_model

    @contextlib.contextmanager
    def _resident(self):
        """Everything back on the device for the duration, then released again as it was."""
        released, weights_kept = self._released, not self._weights_offloaded
        self.restore()
        try:
            yield
        finally:
            if released:
                self.release(keep_weights=weights_kept)

    # -- colocated placement --------------------------------------------------------------

    def release(self, *, keep_weights: bool = False) -> None:
        """Give the GPU back: gradient buffers freed, the weights buffer (unless `keep_weights`)
        copied to pinned host memory by megatron-core's buffer offload (every parameter stays a
        view of its buffer, so nothing is re-wired on resume), the distributed optimizer's fp32
        shards and moments and the reference model into pinned host twins kept for the run (one
        asynchronous copy per tensor; megatron-core's own optimizer offload makes a pageable copy
        per tensor every time, several times slower), the CUDA cache emptied. On CPU only the
        gradients go. Forward passes raise until `restore`."""
        self._gathered = None  # views of the weights being moved (gather_for_push), or host copies
        if not self._released:  # released already (the weights kept): the gradient buffers are gone
            self._zero_grad()
        if not self.cpu:
            torch.cuda.synchronize(self.device)
            self._move_optimizer_and_ref(torch.device("cpu"))  # before the buffers: fp32 shards may be views of them
            for buffer in self._ddp_buffers():
                buffer.offload_to_cpu(move_params=not keep_weights, move_grads=True)
            self._weights_offloaded = self._weights_offloaded or not keep_weights
            self._offload.wait(self.device)
            torch.cuda.empty_cache()
        self._released = True

    def restore(self) -> None:
        if not self._released:
            return
        if not self.cpu:
            for buffer in self._ddp_buffers():
                buffer.reload_from_cpu(move_params=True, move_grads=True)
            self._weights_offloaded = False
            self._move_optimizer_and_ref(self.device)
            self._offload.wait(self.device)
        self._released = False

    def _move_optimizer_and_ref(self, device: torch.device) -> None:
        for i, inner in enumerate(getattr(self.optimizer, "chained_optimizers", [self.optimizer])):
            if getattr(inner, "optimizer", None) is not None:  # None: a rank without parameters
                self._offload.move_optimizer(inner.optimizer, f"optimizer{i}", device, params=True)
        if self.ref_model is not None:
            self._offload.move_module(self.ref_model, "ref", device)

    @contextlib.contextmanager
    def _weights_resident(self):
        """The weights on the GPU for the duration (they were offloaded by release)."""
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


    # -- building -------------------------------------------------------------------------

    def _build(self, hf_dir: str) -> torch.nn.Module:
        model = build_gpt_model(self.tconfig, self.arch, pre_process=self.first_stage, post_process=self.last_stage)
        load_hf_into(model, hf_dir, self.arch, tp_rank=self.tp_rank, tp_size=self.tp_size,
                     first_expert=self.ep_rank * self.experts_per_rank, expert_tp=(self.etp_rank, self.etp_size))
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

    # -- one schedule run -----------------------------------------------------------------

    def _run(self, module: torch.nn.Module, micro: list[dict[str, Any]], *, forward_only: bool, loss,
             replay: bool = False) -> list[Any]:
        """Forward (and backward) every micro-batch; returns what `loss` reported for each.
        `replay`: the actor runs, and under routing replay its routers take the engine's experts.

        Pipelined: megatron-core's 1F1B schedule. Otherwise the same steps in a plain loop (the
        schedule's no-pipelining variant allocates on CUDA, and this loop also runs on CPU):
        the loss divided by the micro-batch count, as the schedule does, gradients synchronised
        after the last micro-batch.
        """
        if self.pp_size == 1:
            reported = []
            real = sum(mb["weight"] for mb in micro)
            for k, mb in enumerate(micro):
                sync = k == len(micro) - 1 or forward_only
                tracked = _moe_loss_tracker_values() if mb["weight"] == 0 and self._moe_losses_on else None
                with (contextlib.nullcontext() if sync or self.cpu else module.no_sync(),
                      self._replaying(mb, replay, count=not forward_only)):
                    output = self._forward(module, mb)
                    value, report = loss(mb, output)
                    if not forward_only:
                        self._scale_moe_losses(mb["weight"], real)
                        (value / len(micro)).backward()
                if tracked is not None:  # an empty micro-batch's load-balancing losses are not reported either
                    _restore_moe_loss_tracker(tracked)
                reported.append(report)
            if not forward_only and self.tconfig.finalize_model_grads_func is not None:
                self.tconfig.finalize_model_grads_func([module])
            return reported

        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return self._forward(model, mb), partial(loss, mb)

        first = micro[0]["input_ids"]
        # The schedule scales every micro-batch's MoE losses alike; a rank whose share is empty
        # (only zero-weight passes) must add none. Fewer samples than ranks is the one such case:
        # the zero-weight passes that even expert ranks are refused beside pipelining.
        empty = self._moe_losses_on and not any(mb["weight"] for mb in micro)
        with moe_losses_off() if empty else contextlib.nullcontext():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[module],
                num_microbatches=len(micro),
                seq_length=first.shape[1],
                micro_batch_size=first.shape[0],
                forward_only=forward_only,
            )

    @contextlib.contextmanager
    def _replaying(self, mb: dict[str, Any], replay: bool, *, count: bool = False):
        """Under routing replay (and `replay`), the actor's routers take `mb`'s engine experts
        through its forward and backward; `count`: and count where their own would differ."""
        if self._route_replay is None or not replay:
            yield
            return
        routes = mb["batch"].routed_experts
        if routes is None:
            raise ValueError("spec.training.routingReplay is on, and the rollout's samples carry no routed experts "
                             "(the engines return them only when started with --enable-return-routed-experts)")
        rows, length = mb["input_ids"].shape
        targets, real = replay_targets(routes, rows, length, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                       sequence_parallel=self.sizes.sequence_parallel, device=self.device)
        # A zero-weight micro-batch (expert ranks evened) repeats a sample: not counted.
        self._route_replay.replay(targets, real if count and mb["weight"] else None)
        try:
            yield
        finally:
            self._route_replay.stop()

    @property
    def _moe_losses_on(self) -> bool:
        """megatronArgs turned on a load-balancing or z-loss (a dense model has neither)."""
        return bool(self.arch.num_experts and (self.tconfig.moe_z_loss_coeff or self.tconfig.moe_aux_loss_coeff))

    def _scale_moe_losses(self, weight: float, real_micro_batches: float) -> None:
        """The gradient scale of the MoE load-balancing losses in the micro-batch about to be
        back-propagated, as megatron-core's schedule sets it (over the micro-batch count, then
        averaged over data-parallel ranks: DDP averages on GPU, the CPU reduce sums) but counting
        only real micro-batches: an empty one that keeps expert ranks in step adds nothing."""
        if not self._moe_losses_on:
            return
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        per_rank = weight / max(real_micro_batches, 1.0)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(per_rank / (self.dp_size if self.cpu else 1), device=self.device))

    def _forward(self, module: torch.nn.Module, mb: dict[str, Any]) -> torch.Tensor:
        self._positions = (mb["rows"], mb["cols"])
        try:
            return module(mb["input_ids"], mb["position_ids"], mb["attention_mask"])
        finally:
            self._positions = None

    def _rank_micro_batches(self, batch: TrainBatch) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """This data-parallel rank's share of `batch` as micro-batches (and their plan), evened
        over the ranks its experts exchange tokens with when experts are split."""
        mine = partition_for_ranks(batch.total_lengths, self.dp_size)[self.dp_rank]
        local = batch.select(mine)
        plan = self._plan(local)
        micro = [self._micro_batch(local, group, [mine[i] for i in group]) for group in plan]
        if self.sizes.expert > 1:
            from megatron.core import parallel_state as ps

            micro = experts.even_micro_batches(micro, partial(self._zero_weight_micro_batch, batch),
                                               ps.get_expert_tensor_and_model_parallel_group(), same_shape=self.cpu)
        return micro, plan

    def _zero_weight_micro_batch(self, batch: TrainBatch) -> dict[str, Any]:
        """A pass that adds nothing (weight 0) but takes part in the collectives of a real one."""
        return self._micro_batch(batch, [0], [0], weight=0.0)

    def _micro_batch(self, batch: TrainBatch, group: list[int], index: list[int], *, weight: float = 1.0) -> dict[str, Any]:
        pad_to = self.tp_size if self.sizes.sequence_parallel else 1
        return model_inputs(batch.select(group), index, pad_to=pad_to, device=self.device, weight=weight)

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
        loss, metrics = self.micro_batch_loss(mb["batch"], logp, ent, num_samples=counts[0], num_tokens=counts[1])
        weight = mb["weight"]
        # The schedule divides by the micro-batch count; DDP (GPU) averages over data-parallel ranks.
        scale = num_micro * (1 if self.cpu else self.dp_size) * weight
        return loss * scale, {k: float(v) * weight for k, v in metrics.items()}

    def _zero_grad(self) -> None:
        if self.cpu:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.train_module.zero_grad_buffer()
            self.optimizer.zero_grad()

    # -- helpers --------------------------------------------------------------------------


    @property
    def _reports(self) -> bool:
        """Whether this rank's per-sample results and loss sums are the ones every rank receives:
        the last pipeline stage computes them, and its tensor-parallel ranks all hold the same."""
        return self.last_stage and self.tp_rank == 0

    def _gather_tp(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of `name` from its tensor-parallel shards (an expert's: over expert-tensor-parallel ranks)."""
        from megatron.core import parallel_state as ps

        expert = convert.is_expert(name)
        size = self.etp_size if expert else self.tp_size
        if size == 1 or not convert.is_tp_sharded(name):
            return tensor
        group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return convert.tp_merge(name, parts)
