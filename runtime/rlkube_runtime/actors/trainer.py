"""One trainer rank: turns a rollout's rewarded samples into optimizer steps.

The loop calls every method on every rank with the same arguments (the whole rollout); the
backend splits the work. Per rollout, in slime's order: old (and reference) log-probs, the
advantages, then `numStepsPerRollout` optimizer steps of `globalBatchSize` samples each.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkube_runtime.data.sample import Sample
from rlkube_runtime.node_network import (
    NodeNetworkError,
    check_ranks_reach_each_other,
    describe_node,
    rendezvous_store,
    socket_ifname_env,
)
from rlkube_runtime.serving.launch import node_ip
from rlkube_runtime.spec import RLJobSpec
from rlkube_runtime.spec.backend_rules import chosen_backend
from rlkube_runtime.trainer.support import check_trainer_supports

if TYPE_CHECKING:
    import torch

    from rlkube_runtime.trainer.batch import TrainBatch

# torch and everything that imports it load in the methods, in the trainer's process: the driver
# imports this module too (ray.remote needs the class) and otherwise never needs torch.

__all__ = ["TrainerWorker", "check_trainer_supports", "logprob_abs_diff", "to_train_batch"]


class TrainerWorker:
    def __init__(
        self,
        spec: dict[str, Any],
        *,
        hf_checkpoint: str,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",  # one rank, or one machine; the TrainerGroup passes rank 0's node IP
        master_port: int = 29500,
        device: str = "cpu",
        num_threads: int | None = None,
    ):
        import torch

        from rlkube_runtime.algorithms import AdvantageConfig
        from rlkube_runtime.trainer.config import TrainerConfig
        from rlkube_runtime.trainer.registry import build_backend

        self.spec = RLJobSpec.model_validate(spec)
        check_trainer_supports(self.spec)
        if num_threads:
            torch.set_num_threads(num_threads)
        # Before any process group (the ranks' own, the weight groups to the engines): gloo and
        # NCCL listen on this node's address, not on what the host name resolves to.
        address = node_ip()
        os.environ.update(socket_ifname_env(address, os.environ))
        # The ranks' rendezvous store (None for one rank) also carries the IPC handles that the
        # ranks on one engine's GPUs hand its pusher (weight_sync.HandleGroup).
        self._store = None
        if world_size > 1:
            self._store = _join_ranks("nccl" if device == "cuda" else "gloo", rank, world_size, master_addr, master_port, address)
        # The model comes from the run's plan (a built tiny checkpoint, the HF checkpoint, or the
        # weights of a resumed run), not from spec.model.hfCheckpoint.
        self.config = TrainerConfig.from_spec(self.spec, hf_checkpoint=hf_checkpoint)
        self.backend = build_backend(self.spec, self.config, device=device)
        self.advantages = AdvantageConfig.from_spec(self.spec)
        self.rank = rank
        self._sender = None  # a weight_sync.WeightSender, made at the first push
        self._last_advantages: list[torch.Tensor] = []

    def ready(self) -> bool:
        """Once the model is built: whether a push needs `stage_weights` on every rank first."""
        return self.backend.gathers_for_push

    def gpus(self) -> tuple[str, list[int]]:
        """(this rank's node IP, the GPU ids Ray gave it): a colocated engine over several GPUs is
        handed its ranks' GPUs by id."""
        import ray

        return node_ip(), [int(i) for i in ray.get_gpu_ids()]

    def train(self, rollout_id: int, samples: list[dict[str, Any]]) -> dict[str, float]:
        """Train on one rollout's samples (as `Sample.to_dict()`); returns slime-named metrics."""
        from rlkube_runtime.algorithms import compute_approx_kl

        batch_samples = [Sample.from_dict(s) for s in samples]
        batch = to_train_batch(batch_samples, routes=self.backend.replayed_routes)
        algo = self.spec.algorithm
        needs_ref = self.config.loss.needs_ref_model

        old = self.backend.log_probs(batch, model="actor")
        batch = batch.with_fields(old_log_probs=old.log_probs)
        kl = None
        if needs_ref:
            ref = self.backend.log_probs(batch, model="ref")
            batch = batch.with_fields(ref_log_probs=ref.log_probs)
            kl = [
                compute_approx_kl(o, r, algo.kl_loss_type)
                for o, r in zip(old.log_probs, ref.log_probs)
            ]
        advantages, _returns = self.advantages.compute(
            rewards=[float(s.reward) for s in batch_samples], loss_masks=batch.loss_masks, kl=kl
        )
        batch = batch.with_fields(advantages=[a.float() for a in advantages])
        self._last_advantages = batch.advantages

        steps = [self.backend.train_step(step) for step in batch.global_batches(self.spec.global_batch_size)]
        metrics = {f"train/{key}": sum(s[key] for s in steps) / len(steps) for key in steps[0]}
        metrics["train/num_steps"] = float(len(steps))
        every = self.spec.training.ref_update_interval
        if every is not None and (rollout_id + 1) % every == 0:  # in the state the next checkpoint saves
            self.backend.refresh_reference()
        if batch.rollout_log_probs is not None:
            metrics["train/train_rollout_logprob_abs_diff"] = logprob_abs_diff(
                batch.old_log_probs, batch.rollout_log_probs, batch.loss_masks
            )
        return metrics

    def last_advantages(self, count: int) -> list[list[float]]:
        """The per-token advantages of the first `count` samples of the last trained rollout (for
        the rollout dump)."""
        return [a.tolist() for a in self._last_advantages[:count]]

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.backend.export_weights()

    def stage_weights(self, keep: bool = True) -> None:
        """Before a push or an HF export (collective over every trainer rank): the whole model
        readable on this rank for the pushes that follow, which run on the pushing ranks alone;
        `keep` is False on ranks that push to no engine. Megatron gathers its shards here; the
        torch backend has nothing to do (every rank holds the whole model)."""
        self.backend.gather_for_push(keep)

    def save(self, directory: str) -> str | None:
        """This rank's part of a checkpoint into `directory` (collective), in the backend's own
        format, which it returns for the checkpoint's payload."""
        self.backend.save(directory)
        return self.backend.checkpoint_format

    def load(self, directory: str, fmt: str | None, state: dict[str, Any] | None = None,
             rng: dict[str, Any] | None = None) -> None:
        """Restore what `save` wrote (collective). From a checkpoint written before the trainer
        wrote its own files: `state`, rank 0's trainer state from its payload, and `rng`, this
        rank's streams."""
        if fmt != self.backend.checkpoint_format:
            raise ValueError(f"the checkpoint in {directory} is in the {fmt or 'torch'} trainer format; "
                             f"the {chosen_backend(self.spec)[0]} backend reads "
                             f"{self.backend.checkpoint_format or 'torch'}")
        if state is not None:
            self.backend.load_state_dict(state)
        else:
            self.backend.load(directory)
        if rng is not None:
            from rlkube_runtime.trainer.rng import restore_rng_state

            restore_rng_state(rng)

    def push_weights(self, urls: list[str], plan, version: str):
        """Load this rank's weights into the engines at `urls` (paused and flushed by the engine
        pool) as the `weight_sync.SyncPlan` says; returns the `weight_sync.SyncReport`."""
        handles = None
        place = plan.handle_group_of(self.rank)
        if place is not None:
            from rlkube_runtime.weight_sync import HandleGroup

            engine, position, size = place
            handles = HandleGroup(self._store, engine, position, size)
        return self._weight_sender(plan).push(urls, transport=plan.transport, version=version, disk_dir=plan.disk_dir,
                                              handles=handles)

    def _weight_sender(self, plan):
        """This rank's WeightSender, made at the first push (it keeps its staging buffer and
        process groups for the run)."""
        if self._sender is None:
            import torch

            from rlkube_runtime.trainer.push_view import PushView
            from rlkube_runtime.weight_sync import WeightSender

            self._sender = WeightSender(
                PushView(self.backend),
                dtype=getattr(torch, plan.dtype),
                bucket_bytes=plan.bucket_bytes,
                device=self.backend.device,
                node_ip=node_ip(),
                save_hf=self.save_hf,
                save_adapter=self.backend.save_adapter,
                engine_ranks=plan.engine_ranks,
                quantization=plan.quantization,
            )
        return self._sender

    def save_hf(self, directory: str) -> str:
        """The current weights as an HF directory (after `stage_weights`; on one rank)."""
        return str(self.backend.save_hf(directory))

    def export_hf(self, directory: str) -> str:
        """`save_hf` written beside `directory` and renamed to it when complete, so a crash or a
        full disk mid-export leaves no half-written export under the name users load."""
        from rlkube_runtime.trainer.checkpoint import publish_directory, temporary_sibling

        final = Path(directory)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_sibling(final)
        try:
            self.backend.save_hf(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return str(publish_directory(tmp, final))

    def release(self, keep_weights: bool = False) -> None:
        self.backend.release(keep_weights=keep_weights)

    def restore(self) -> None:
        self.backend.restore()

    def close(self) -> None:
        """Leave the process group together (a barrier, then destroy): a rank whose process ends
        with the group alive, or while a peer still uses it, aborts in gloo's threads."""
        import torch

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _join_ranks(backend: str, rank: int, world_size: int, master_addr: str, master_port: int, address: str):
    """The default process group of the trainer ranks: they meet at rank 0's node, check that each
    reaches every other at its node `address`, then build the group on that store (returned)."""
    import torch

    node = describe_node(address)
    store = rendezvous_store(master_addr, master_port, rank, world_size, node)
    check_ranks_reach_each_other(store, rank, world_size, address)
    try:
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    except RuntimeError as err:
        # The ranks reached each other at their node addresses a moment ago: if the group cannot
        # connect, what is left is the interface gloo or NCCL was told to listen on.
        chosen = ", ".join(f"{var}={os.environ.get(var, '(unset)')}" for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"))
        raise NodeNetworkError(
            f"trainer rank {rank} on {node}: the {backend} process group of {world_size} ranks did not form ({chosen}): "
            f"{err}. The ranks do reach each other at their node addresses; if the group could not connect, the "
            "interface named must be one the pods reach each other on"
        ) from err
    return store


def to_train_batch(samples: list[Sample], *, routes: tuple[int, int] | None = None) -> TrainBatch:
    """Rewarded samples to the trainer's column layout (advantages filled in later); `routes`
    (layers, top_k): routing replay is on and each sample's routed experts come along."""
    from rlkube_runtime.trainer.batch import TrainBatch

    for s in samples:
        s.check_lengths()
    have_logprobs = all(s.rollout_log_probs is not None for s in samples)
    batch = TrainBatch.from_lists(
        tokens=[s.tokens for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=[s.loss_mask if s.loss_mask is not None else [1] * s.response_length for s in samples],
        advantages=[[0.0] * s.response_length for s in samples],
        rollout_log_probs=[s.rollout_log_probs for s in samples] if have_logprobs else None,
    )
    if routes is None:
        return batch
    return batch.with_fields(routed_experts=[sample_routes(s, *routes) for s in samples])


def sample_routes(sample: Sample, num_layers: int, top_k: int) -> torch.Tensor:
    """The [tokens - 1, layers, top_k] experts the engine routed `sample`'s tokens to. Tokens a
    generate function added after its last generation (a tool's output that used up the budget)
    have no routes; untrained, they change nothing trained, and get experts 0..k-1 as the padding
    does (trainer/megatron/routing_replay.py)."""
    import torch

    from rlkube_runtime.routed_experts import decode_routes

    what = f"sample index={sample.index} group_index={sample.group_index}"
    if sample.routed_experts is None:
        raise ValueError(f"{what}: spec.training.routingReplay is on and the sample has no routed experts (the "
                         "engines return them with --enable-return-routed-experts; a custom generate function must "
                         "send return_routed_experts and keep meta_info.routed_experts, as rollout.generate does)")
    routes = decode_routes(sample.routed_experts, num_layers=num_layers, top_k=top_k, what=what)
    needed, covered = len(sample.tokens) - 1, routes.shape[0]
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    # Response token i sits at position prompt_length + i and is predicted from the one before it.
    trained_up_to = max((sample.prompt_length + i for i, m in enumerate(mask) if m), default=0)
    if covered > needed or covered < trained_up_to:
        raise ValueError(f"{what}: the engine's routed experts cover {covered} tokens; routing replay needs every "
                         f"token but the last ({needed}), or at least up to the last trained one ({trained_up_to})")
    tail = torch.arange(top_k, dtype=torch.long).expand(needed - covered, num_layers, top_k)
    return torch.cat([routes, tail]) if needed > covered else routes


def logprob_abs_diff(trainer: list[torch.Tensor], engine: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
    """Mean |trainer - engine| log-prob over trained tokens: do rollout and training agree?"""
    total = sum(float(((t - e).abs() * m).sum()) for t, e, m in zip(trainer, engine, masks))
    count = sum(float(m.sum()) for m in masks)
    return total / count if count else 0.0
