"""MegatronBackend across two CPU processes (gloo): tensor parallelism with and without sequence
parallelism, two data-parallel ranks, and a mixture of experts split over two expert-parallel
ranks (4 of its 8 experts each), also beside tensor parallelism with whole experts
(parallelism.expertTensor 1). Each takes the same step as one process does (the TorchBackend;
for the MoE model the one-process MegatronBackend, whose step test_megatron_backend checks
against the TorchBackend's): loss, gradient norm, weights after the step. A distributed
checkpoint saved by the two ranks gives the identical next step after loading."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from megatron_testutil import tiny_hf
from trainer_testutil import random_batch

from rlkube_runtime.trainer.config import BatchingConfig, ModelConfig, OptimizerConfig, TrainerConfig
from rlkube_runtime.trainer.torch_backend import TorchBackend

LENGTHS = [(9, 4), (14, 6), (5, 2), (20, 9), (11, 3)]


def _config(path) -> TrainerConfig:
    return TrainerConfig(model=ModelConfig(hf_checkpoint=str(path)), optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0),
                         batching=BatchingConfig(max_tokens_per_gpu=30))


def _batch(old):
    batch = random_batch(LENGTHS, vocab=(8, 120))
    return batch.with_fields(old_log_probs=[o + 0.1 for o in old]) if old is not None else batch


def _rank(rank: int, store: str, hf: str, tensor: int, sp: bool, expert: int, etp: int | None, ckpt: str,
          result: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    from rlkube_runtime.trainer.megatron.backend import MegatronBackend
    from rlkube_runtime.trainer.megatron.model import ParallelSizes

    sizes = ParallelSizes(tensor=tensor, sequence_parallel=sp, expert=expert, expert_tensor=etp)
    backend = MegatronBackend(_config(hf), sizes, device="cpu")
    if expert > 1:  # each rank holds its own 8 / expert of the experts
        experts = backend.model.decoder.layers[0].mlp.experts.local_experts
        assert len(experts) == 8 // expert
        # Split over the expert-tensor ranks (the tensor ranks unless set): fc1 holds gate and up.
        assert experts[0].linear_fc1.weight.shape[0] == 2 * backend.arch.moe_ffn_hidden_size // sizes.etp
    batch = _batch(backend.log_probs(_batch(None)).log_probs)
    first = backend.train_step(batch)
    weights = backend.export_weights()
    backend.save_distributed(ckpt)
    second = backend.train_step(batch)
    again = MegatronBackend(_config(hf), sizes, device="cpu")
    again.load_distributed(ckpt)
    resumed = again.train_step(batch)
    if rank == 0:
        # Plain dicts: the result file is read back with weights_only=True, which loads no classes.
        torch.save((dict(first), weights, dict(second), dict(resumed)), result)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "tensor", "sp", "expert", "etp"),
                         [("qwen3", 2, False, 1, None), ("qwen3", 2, True, 1, None), ("qwen3", 1, False, 1, None),
                          ("qwen3_moe", 1, False, 2, None), ("qwen3_moe", 2, True, 2, 1)],
                         ids=["tp2", "tp2-sp", "dp2", "moe-ep2", "moe-tp2-sp-ep2-etp1"])
def test_two_ranks_step_like_one_process_and_resume_exactly(kind, tensor, sp, expert, etp, tmp_path):
    import torch.multiprocessing as mp

    hf = tiny_hf(kind, tmp_path / "hf")
    env = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env])
    try:
        mp.start_processes(_rank, args=(str(tmp_path / "store"), str(hf), tensor, sp, expert, etp, str(tmp_path / "ckpt"),
                                        str(tmp_path / "result.pt")),
                           nprocs=2, start_method="spawn")
    finally:
        os.environ["PYTHONPATH"] = env
    first, weights, second, resumed = torch.load(tmp_path / "result.pt", weights_only=True)

    if expert > 1:
        from rlkube_runtime.trainer.megatron.backend import MegatronBackend

        ref = MegatronBackend(_config(hf), device="cpu")
    else:
        ref = TorchBackend(_config(hf), device="cpu")
    want = ref.train_step(_batch(ref.log_probs(_batch(None)).log_probs))
    for key in ("loss", "pg_loss", "grad_norm"):
        assert first[key] == pytest.approx(want[key], rel=1e-5), key
    expected = ref.export_weights()
    assert set(weights) == set(expected)  # every expert, from both ranks, by its global name
    for name, tensor_ in expected.items():
        # Adam's first step (see test_megatron_backend): where a gradient is ~eps, summation-order
        # noise moves the update by a fraction of lr (1e-3); a tenth of lr at most, ~nothing on average.
        diff = (weights[name] - tensor_).abs()
        assert diff.max() < 1e-4 and diff.mean() < 1e-7, (name, diff.max(), diff.mean())
    assert resumed == second
