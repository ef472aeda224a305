"""The one contract a trainer backend fulfils, whatever trains: the PyTorch backend or Megatron-core.

The trainer actor (actors/trainer.py) calls these and nothing else:

    backend.log_probs(batch, model="actor" | "ref")      # collective: every rank, the whole batch
    backend.train_step(step_batch) -> StepReport         # collective: one optimizer step
    backend.save(dir) / backend.load(dir)                # collective: a checkpoint, in the backend's format
    backend.gather_for_push(keep)                        # collective: the whole model on the pushing ranks
    backend.weights_for_push() -> (HF name, tensor)...   # on a pushing rank: what the weight sync sends
    backend.save_hf(dir)                                 # on one rank, after gather_for_push
    backend.save_adapter(dir)                            # spec.training.lora: the adapter alone (peft's format)
    backend.release(keep_weights=...) / backend.restore()  # colocated: give device memory back, take it again
    backend.refresh_reference()                          # the reference takes the actor's weights

Every data-parallel rank holds one backend; a collective call is made on all ranks with the same
arguments (each computes its own share). `train_step` is a template method: the backend
accumulates the gradient of the global-batch loss (`accumulate_gradients`) and clips and steps
(`clip_and_step`); the schedule, the skipped-step rule and the StepReport are the same for all.
The checkpoint format (one state file from rank 0, or per-rank megatron shards) is the
backend's own: `checkpoint_format` names it in the checkpoint's payload.
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
import torch.distributed as dist

from ..algorithms.loss import policy_objective
from .batch import TrainBatch
from .packing import DEFAULT_MAX_TOKENS_PER_GPU, plan_micro_batches


@dataclass(frozen=True)
class LogProbs:
    """Per-sample results of a forward pass, in batch order, float32 on CPU.

    log_probs: [R_i] log p(response token) under log_softmax(logits / temperature).
    entropy:   [R_i] entropy of that distribution per response position, or None when not asked.
    """

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None = None

    @classmethod
    def in_batch_order(cls, results: dict[int, tuple[torch.Tensor, torch.Tensor | None]], size: int, *,
                       with_entropy: bool) -> LogProbs:
        """From {sample index: (log-probs, entropy)}, gathered from every rank's share."""
        return cls(log_probs=[results[i][0] for i in range(size)],
                   entropy=[results[i][1] for i in range(size)] if with_entropy else None)


def pick_model(model: str, actor: torch.nn.Module, ref: torch.nn.Module | None) -> torch.nn.Module:
    """The module `log_probs(model=...)` runs, or an error naming what is missing."""
    if model == "actor":
        return actor
    if model != "ref":
        raise ValueError(f"model must be 'actor' or 'ref', got {model!r}")
    if ref is None:
        raise ValueError(
            "log_probs(model='ref') needs a reference model; it is loaded when algorithm.use_kl_loss is true"
        )
    return ref


def joined_over_ranks(share: dict) -> dict:
    """Every rank's `share` (their keys are disjoint, e.g. sample indices) as one dict on every
    rank. Collective when torch.distributed runs more than one rank."""
    return {key: value for part in _gathered(share) for key, value in part.items()}


def summed_over_ranks(share: dict[str, float]) -> dict[str, float]:
    """Every rank's metric sums added up, key by key, on every rank. Collective like joined_over_ranks."""
    total: dict[str, float] = {}
    for part in _gathered(share):
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _gathered(share: dict) -> list[dict]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [share]
    gathered: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, share)
    return gathered


# spec.model.dtype -> the compute dtype on a GPU (a CPU trainer computes in float32).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Set to 0 to run a GPU trainer's layers and log-prob chunks eagerly (debugging, or a model
# torch.compile rejects).
COMPILE_ENV = "RLKUBE_TORCH_COMPILE"


def compile_enabled() -> bool:
    return os.environ.get(COMPILE_ENV, "1") not in ("0", "false", "False", "")


@dataclass(frozen=True, eq=False)
class StepReport(Mapping):
    """What one optimizer step did. As a mapping (what the actor averages and logs): the loss
    metrics summed over micro-batches and ranks ("loss", "pg_loss", ...), "num_micro_batches"
    (this rank's), "grad_norm" (before clipping), "lr" (used by this step) and "skipped_step"
    (1.0 when the norm was not finite and no step was taken)."""

    loss: Mapping[str, float]
    grad_norm: float
    lr: float

    @property
    def skipped(self) -> bool:
        return not math.isfinite(self.grad_norm)

    def as_dict(self) -> dict[str, float]:
        return {**self.loss, "grad_norm": self.grad_norm, "lr": self.lr, "skipped_step": float(self.skipped)}

    def __getitem__(self, key: str) -> float:
        return self.as_dict()[key]

    def __iter__(self):
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


class TrainerBackend(abc.ABC):
    """The contract (see the module's docstring). Subclasses set `device`, `schedule` (an
    LRSchedule) and `checkpoint_format`, and implement the abstract methods."""

    checkpoint_format: ClassVar[str | None] = None
    # Whether `gather_for_push` does anything (the model is sharded over the ranks).
    gathers_for_push: ClassVar[bool] = False
    # Under routing replay, the (layers, top_k) of the routes a TrainBatch must carry; else None.
    replayed_routes: tuple[int, int] | None = None
    device: torch.device

    @abc.abstractmethod
    def log_probs(
        self, batch: TrainBatch, *, model: Literal["actor", "ref"] = "actor", with_entropy: bool = False
    ) -> LogProbs:
        """Log-probs of every sample's response tokens under the actor or the frozen reference.

        No gradients. Collective: every rank computes its share and all receive the whole result.
        """

    def train_step(
        self,
        batch: TrainBatch,
        *,
        global_num_samples: int | None = None,
        global_num_tokens: int | None = None,
    ) -> StepReport:
        """One optimizer step over a global batch (needs old_log_probs, and ref_log_probs for KL).

        The loss is `policy_objective` reduced with the global counts (None: counted from
        `batch`), so the step is the same however the batch is split into micro-batches and
        ranks. A non-finite gradient norm skips the step (the schedule still advances).
        """
        loss = self.accumulate_gradients(batch, global_num_samples=global_num_samples, global_num_tokens=global_num_tokens)
        lr = self.schedule.apply()
        grad_norm = self.clip_and_step()
        self.schedule.advance()
        return StepReport(loss, grad_norm, lr)

    @abc.abstractmethod
    def accumulate_gradients(
        self, batch: TrainBatch, *, global_num_samples: int | None = None, global_num_tokens: int | None = None
    ) -> dict[str, float]:
        """The first half of `train_step`: every parameter's gradient of the global-batch loss,
        no step. Returns the loss metrics summed over micro-batches and ranks, and
        "num_micro_batches" (this rank's)."""

    @abc.abstractmethod
    def clip_and_step(self) -> float:
        """The second half: clip (spec.training.optimizer.clipGrad), step when the norm is finite,
        drop the gradients. Returns the norm before clipping."""

    @abc.abstractmethod
    def save(self, directory: str | Path) -> None:
        """Collective: this rank's part of a checkpoint (model, optimizer, schedule) into `directory`."""

    @abc.abstractmethod
    def load(self, directory: str | Path) -> None:
        """Collective: restore what `save` wrote; the next train_step is then identical."""

    def gather_for_push(self, keep: bool = True) -> None:
        """Collective: make the whole model readable by `weights_for_push` on this rank (`keep`:
        whether this rank pushes). Nothing to do where every rank holds the whole model."""

    @abc.abstractmethod
    def weights_for_push(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights, tied tensors once, as they are (not copies; on the training device
        or the host): what a weight sync sends, in buckets the sender plans."""

    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named parameters and buffers, float32 on CPU, owned by the caller (copies)."""
        return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in self.weights_for_push()}

    @abc.abstractmethod
    def save_hf(self, directory: str | Path) -> Path:
        """Write an HF model directory (config, weights, tokenizer) that an engine can load; returns it."""

    def save_adapter(self, directory: str | Path) -> Path:
        """The LoRA adapter as a peft directory (the `adapter` weight sync); only under spec.training.lora."""
        raise ValueError(f"{type(self).__name__} trains no LoRA adapter (spec.training.lora is unset or not its)")

    @abc.abstractmethod
    def release(self, *, keep_weights: bool = False) -> None:
        """Give accelerator memory back (colocated placement) until `restore`; `keep_weights`
        leaves the weights in place for a weight sync from device memory."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Undo `release`; training continues exactly where it was."""

    # -- the reference model (training.refUpdateInterval) ---------------------------------

    # Whether the reference holds the actor's weights of a refresh rather than its initial ones:
    # a checkpoint then carries the reference's weights too, so a resume compares with the same one.
    ref_refreshed: bool = False

    def refresh_reference(self) -> None:
        """The reference model takes the actor's current weights (slime's ref update). Each rank
        copies its own shard, so it is collective only in that every rank calls it."""
        actor, ref = self.actor_and_reference()
        if ref is None:
            raise ValueError("training.refUpdateInterval needs a reference model; it is loaded when a KL term is on")
        actor_params, ref_params = dict(actor.named_parameters()), dict(ref.named_parameters())
        if actor_params.keys() != ref_params.keys():
            raise ValueError(f"the reference model's parameters are not the actor's: "
                             f"{sorted(actor_params.keys() ^ ref_params.keys())[:5]}")
        with torch.no_grad():
            for name, param in actor_params.items():
                ref_params[name].copy_(param)
        self.ref_refreshed = True

    @abc.abstractmethod
    def actor_and_reference(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """This rank's actor model and reference model (None without a KL term), unwrapped,
        built alike so that their parameters pair by name."""

    # -- what both backends' halves share --------------------------------------------------

    # Micro-batches hold up to this many padded tokens without spec.parallelism.maxTokensPerGpu.
    default_max_tokens: int = DEFAULT_MAX_TOKENS_PER_GPU

    @property
    def memory_released(self) -> bool:
        return getattr(self, "_released", False)

    def _plan(self, batch: TrainBatch) -> list[list[int]]:
        """This rank's share of `batch` in micro-batches (lists of sample indices)."""
        b = self.config.batching
        return plan_micro_batches(
            batch.total_lengths,
            dynamic_batch_size=b.dynamic_batch_size,
            max_tokens_per_gpu=b.max_tokens_per_gpu,
            micro_batch_size=b.micro_batch_size,
            default_max_tokens=self.default_max_tokens,
        )

    def micro_batch_loss(
        self, mb: TrainBatch, log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None, *,
        num_samples: int, num_tokens: int,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`policy_objective` of one micro-batch, given its [R_i] log-probs (and entropy) on the
        device, reduced with the global batch's counts so micro-batch losses add up to the step's."""
        return policy_objective(
            log_probs=log_probs,
            old_log_probs=self._to_device(mb.old_log_probs),
            advantages=self._to_device(mb.advantages),
            loss_masks=self._to_device(mb.loss_masks),
            entropy=entropy,
            ref_log_probs=self._to_device(mb.ref_log_probs),
            rollout_log_probs=self._to_device(mb.rollout_log_probs),
            global_num_samples=num_samples,
            global_num_tokens=num_tokens,
            config=self.config.loss,
        )

    def _to_device(self, tensors: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        return None if tensors is None else [t.to(self.device, non_blocking=True) for t in tensors]

    def _check_resident(self, what: str) -> None:
        if getattr(self, "_released", False):
            raise RuntimeError(f"{what} called while the trainer's memory is released; call restore() first")
