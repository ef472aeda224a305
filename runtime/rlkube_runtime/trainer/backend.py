"""What the loop needs from a trainer, whatever trains: the PyTorch backend or Megatron-core.

Every data-parallel rank holds one backend. `compute_log_probs` and `train_step` are collective:
call them on all ranks with the same arguments (the whole global batch; each rank computes its
own share). The others read state that is identical on every rank: call them on one rank
(`release_memory`/`resume_memory` on each rank that should give memory back). Per rollout:

    batch = batch.with_fields(old_log_probs=backend.compute_log_probs(batch).log_probs)
    if KL:  batch = batch.with_fields(ref_log_probs=backend.compute_log_probs(batch, model="ref").log_probs)
    for step_batch in batch.global_batches(global_batch_size):
        metrics = backend.train_step(step_batch)
    weights = backend.export_weights()             # or backend.save_hf(dir) for engines loading from disk
    save_checkpoint(root, rollout_id, {"trainer": backend.state_dict(), "data_source": ...})

The megatron backend (trainer/megatron/) differs in three places: `export_weights` and `save_hf`
are collective (the weights are gathered over tensor and pipeline ranks), and checkpoints are
written by every rank (`save_distributed`/`load_distributed`) instead of `state_dict`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from .batch import TrainBatch


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
    """The module `compute_log_probs(model=...)` runs, or an error naming what is missing."""
    if model == "actor":
        return actor
    if model != "ref":
        raise ValueError(f"model must be 'actor' or 'ref', got {model!r}")
    if ref is None:
        raise ValueError(
            "compute_log_probs(model='ref') needs a reference model; it is loaded when algorithm.use_kl_loss is true"
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


def step_metrics(loss_metrics: dict[str, float], *, grad_norm: float, lr: float) -> dict[str, float]:
    """What `train_step` returns: the loss metrics, the gradient norm before clipping, the lr of
    the step, and whether the step was skipped (a non-finite norm: no optimizer step was taken)."""
    return {**loss_metrics, "grad_norm": grad_norm, "lr": lr, "skipped_step": float(not math.isfinite(grad_norm))}


@runtime_checkable
class TrainerBackend(Protocol):
    def compute_log_probs(
        self, batch: TrainBatch, *, model: Literal["actor", "ref"] = "actor", with_entropy: bool = False
    ) -> LogProbs:
        """Log-probs of every sample's response tokens under the actor or the frozen reference.

        No gradients. Collective: every rank computes its share and all receive the whole result.
        """
        ...

    def train_step(
        self,
        batch: TrainBatch,
        *,
        global_num_samples: int | None = None,
        global_num_tokens: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step over a global batch (needs old_log_probs, and ref_log_probs for KL).

        The loss is `policy_objective` reduced with the global counts (None: counted from
        `batch`), so the step is the same however the batch is split into micro-batches and
        ranks. Returns the summed loss metrics ("loss", "pg_loss", ...) plus "grad_norm"
        (before clipping), "lr" (used by this step) and "num_micro_batches" (this rank).
        """
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named parameters and buffers, float32 on CPU, owned by the caller (copies)."""
        ...

    def save_hf(self, directory: str | Path) -> Path:
        """Write an HF model directory (config, weights, tokenizer) that an engine can load; returns it."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state {"model", "optimizer", "scheduler", "rng"}: CPU copies, weights_only-safe."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; the next train_step is then identical."""
        ...

    def release_memory(self) -> None:
        """Give accelerator memory back (colocated placement) until `resume_memory`."""
        ...

    def resume_memory(self) -> None:
        """Undo `release_memory`; training continues exactly where it was."""
        ...
