"""The batch the loop hands a trainer: one entry per sample, response-token tensors per field.

Sample i has `tokens[i]` of length L_i (prompt then response) and a response of
R_i = `response_lengths[i]` tokens, the last R_i of `tokens[i]`. Every per-token field is a 1-D
tensor of length R_i aligned with those response tokens. Samples keep their own lengths (a
list, not a padded matrix) because micro-batches are packed rows, never padded ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..algorithms.loss import PolicyLossConfig
from ..algorithms.reduction import global_counts

# Per-token optional fields, in the order they are filled during a step.
OPTIONAL_TOKEN_FIELDS = ("rollout_log_probs", "old_log_probs", "ref_log_probs")


@dataclass
class TrainBatch:
    """Samples to train on, column by column.

    tokens:            L_i int64 ids, prompt + response (L_i > R_i: the first response token
                       is predicted from the last prompt position).
    response_lengths:  R_i >= 1.
    loss_masks:        [R_i] float, 1 where the token is trained (0: tool output, aborted tail).
    advantages:        [R_i] float, per response token.
    rollout_log_probs: [R_i] the engine's log-probs of the sampled tokens (TIS), or None.
    old_log_probs:     [R_i] the actor's log-probs before this rollout's updates; filled from
                       `TrainerBackend.log_probs(batch, model="actor")`.
    ref_log_probs:     [R_i] the reference model's log-probs (KL loss); filled likewise.
    routed_experts:    [L_i - 1, layers, top_k] int64: the experts the engine routed every token
                       but the last to (rollout routing replay, a mixture of experts), or None.
    """

    tokens: list[torch.Tensor]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    advantages: list[torch.Tensor]
    rollout_log_probs: list[torch.Tensor] | None = None
    old_log_probs: list[torch.Tensor] | None = None
    ref_log_probs: list[torch.Tensor] | None = None
    routed_experts: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("response_lengths", "loss_masks", "advantages", *OPTIONAL_TOKEN_FIELDS, "routed_experts"):
            column = getattr(self, name)
            if column is not None and len(column) != n:
                raise ValueError(f"TrainBatch.{name} has {len(column)} entries, tokens has {n}")
        for i, (tok, r) in enumerate(zip(self.tokens, self.response_lengths)):
            if tok.dim() != 1 or tok.dtype != torch.long:
                raise ValueError(
                    f"TrainBatch.tokens[{i}] must be a 1-D int64 tensor, got shape "
                    f"{tuple(tok.shape)} dtype {tok.dtype}"
                )
            if not 1 <= r < tok.numel():
                raise ValueError(
                    f"TrainBatch.response_lengths[{i}] = {r} must be in [1, {tok.numel() - 1}] "
                    f"(sample has {tok.numel()} tokens and needs at least one prompt token)"
                )
            for name in ("loss_masks", "advantages", *OPTIONAL_TOKEN_FIELDS):
                column = getattr(self, name)
                if column is not None and tuple(column[i].shape) != (r,):
                    raise ValueError(
                        f"TrainBatch.{name}[{i}] has shape {tuple(column[i].shape)}, expected ({r},) "
                        "= one value per response token"
                    )
            routes = self.routed_experts[i] if self.routed_experts is not None else None
            if routes is not None and (routes.dim() != 3 or routes.shape[0] != tok.numel() - 1):
                raise ValueError(
                    f"TrainBatch.routed_experts[{i}] has shape {tuple(routes.shape)}, expected ({tok.numel() - 1}, "
                    "layers, top_k) = the experts of every token but the last"
                )

    @classmethod
    def from_lists(
        cls,
        *,
        tokens: Sequence[Sequence[int]],
        response_lengths: Sequence[int],
        loss_masks: Sequence[Sequence[float]],
        advantages: Sequence[Sequence[float]],
        rollout_log_probs: Sequence[Sequence[float]] | None = None,
    ) -> TrainBatch:
        """Build from plain Python lists (as the rollout side produces them)."""

        def floats(rows):
            return None if rows is None else [torch.as_tensor(r, dtype=torch.float32) for r in rows]

        return cls(
            tokens=[torch.as_tensor(t, dtype=torch.long) for t in tokens],
            response_lengths=[int(r) for r in response_lengths],
            loss_masks=floats(loss_masks),
            advantages=floats(advantages),
            rollout_log_probs=floats(rollout_log_probs),
        )

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def total_lengths(self) -> list[int]:
        """L_i per sample: the tokens each one occupies in a packed row."""
        return [t.numel() for t in self.tokens]

    @property
    def num_loss_tokens(self) -> int:
        """Sum of the loss masks (trained response tokens): the per-token loss's denominator."""
        return int(sum(int(m.sum().item()) for m in self.loss_masks))

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """The samples at `indices`, in that order (shares tensors, copies nothing)."""
        picked = {}
        for f in dataclasses.fields(self):
            column = getattr(self, f.name)
            picked[f.name] = None if column is None else [column[i] for i in indices]
        return TrainBatch(**picked)

    def global_batches(self, global_batch_size: int) -> list[TrainBatch]:
        """Consecutive slices of `global_batch_size` samples, one per optimizer step.

        The batch must divide exactly: a short last step would weigh its samples differently.
        """
        if global_batch_size < 1 or len(self) % global_batch_size != 0:
            raise ValueError(
                f"a rollout of {len(self)} samples does not split into global batches of "
                f"{global_batch_size}; rollout samples must be a multiple of training.global_batch_size"
            )
        return [
            self.select(range(start, start + global_batch_size)) for start in range(0, len(self), global_batch_size)
        ]

    def with_fields(self, **columns: list[torch.Tensor] | None) -> TrainBatch:
        """A copy with some columns replaced (e.g. `old_log_probs=...`), validated again."""
        return dataclasses.replace(self, **columns)


def loss_counts(
    batch: TrainBatch, loss: PolicyLossConfig, *, global_num_samples: int | None, global_num_tokens: int | None
) -> tuple[int, int]:
    """Check that `batch` carries what the objective needs, and return the (samples, masked
    tokens) its loss is normalised by: the global counts given, else `batch`'s own. Every
    backend starts a training step with this, so each refuses the same batches in the same words."""
    if len(batch) == 0:
        raise ValueError("train_step got an empty batch; a global batch needs at least one sample")
    needed = [("old_log_probs", "fill it with log_probs(batch, model='actor')")]
    if loss.use_kl_loss:
        needed.append(("ref_log_probs", "use_kl_loss is on: fill it with log_probs(batch, model='ref')"))
    if loss.use_tis or loss.use_opsm:
        needed.append(("rollout_log_probs", "TIS or OPSM is on: pass the engine's per-token log-probs"))
    for field, how in needed:
        if getattr(batch, field) is None:
            raise ValueError(f"train_step needs TrainBatch.{field}, which is None; {how}")
    samples, tokens = global_counts(batch.loss_masks)
    return (samples if global_num_samples is None else global_num_samples,
            tokens if global_num_tokens is None else global_num_tokens)
