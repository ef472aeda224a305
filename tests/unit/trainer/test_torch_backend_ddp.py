"""Two data-parallel ranks over gloo train exactly like one process on the same global batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rlkube_runtime.trainer.config import (
    BatchingConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    TrainerConfig,
)
from rlkube_runtime.trainer.torch_backend import TorchBackend
from trainer_testutil import random_batch

# Six samples of uneven lengths: ranks get different sample counts and micro-batch counts.
LENGTHS = [(9, 4), (14, 6), (5, 2), (20, 9), (7, 3), (12, 1)]


def run_steps(checkpoint: str, per_token_loss: bool) -> dict:
    """Log-probs, then two steps on 3-sample global batches and one on a 1-sample batch."""
    backend = TorchBackend(
        TrainerConfig(
            model=ModelConfig(hf_checkpoint=checkpoint),
            optimizer=OptimizerConfig(lr=1e-3, warmup_steps=1, clip_grad=1.0),
            batching=BatchingConfig(max_tokens_per_gpu=21),
            loss=LossConfig(per_token_loss=per_token_loss, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01),
        )
    )
    batch = random_batch(LENGTHS)
    old = backend.log_probs(batch).log_probs
    ref = backend.log_probs(batch, model="ref").log_probs
    # Shift old log-probs so the ratio is not 1 and clipping engages.
    batch = batch.with_fields(old_log_probs=[lp + 0.5 * torch.sin(torch.arange(lp.numel())) for lp in old], ref_log_probs=ref)
    steps = [*batch.global_batches(3), batch.select([4])]  # the last leaves one rank without samples
    # Plain dicts: the ranks' results are read back with weights_only=True, which loads no classes.
    metrics = [dict(backend.train_step(step)) for step in steps]
    return {"log_probs": old, "metrics": metrics, "weights": backend.export_weights()}


def _worker(rank: int, world_size: int, init_file: str, checkpoint: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results = {flag: run_steps(checkpoint, flag) for flag in (False, True)}
        if rank == 0:
            torch.save(results, out)
        dist.barrier()  # neither rank leaves while the other still uses the group (gloo aborts)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_update_weights_like_one_process(tiny_checkpoint, tmp_path):
    out = tmp_path / "ddp.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tiny_checkpoint), str(out)), nprocs=2, join=True)
    ddp = torch.load(out, weights_only=True)

    for per_token_loss in (False, True):
        single = run_steps(str(tiny_checkpoint), per_token_loss)
        two = ddp[per_token_loss]
        for a, b in zip(single["log_probs"], two["log_probs"]):
            assert (a - b).abs().max().item() < 1e-5
        for m1, m2 in zip(single["metrics"], two["metrics"]):
            for key in ("loss", "pg_loss", "kl_loss", "entropy_loss", "pg_clipfrac", "grad_norm", "lr"):
                assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        assert single["metrics"][0]["pg_clipfrac"] > 0
        for name, w in single["weights"].items():
            assert (two["weights"][name] - w).abs().max().item() < 1e-5, name
        moved = single["weights"]["model.embed_tokens.weight"]
        assert moved.abs().sum() > 0
