"""MegatronBackend on GPUs (bf16, megatron-core's DDP and distributed optimizer, NCCL): what the
CPU tests cannot reach. Each case runs its ranks as spawned processes (one per GPU), so the test
process itself never initialises torch.distributed or megatron's parallel state.

Run on the GPU machine:
    python -m pytest -q -m gpu tests/unit/trainer/test_megatron_gpu.py
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from megatron_testutil import tiny_hf
from trainer_testutil import random_batch

from rlkube_runtime.trainer.config import BatchingConfig, ModelConfig, OptimizerConfig, TrainerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64)
LENGTHS = [(64, 32), (96, 40), (40, 16), (128, 64), (80, 24), (50, 20), (110, 30), (70, 70 - 8)]
BF16_REL = 2e-2  # bf16 compute against the torch backend's bf16 autocast: different kernels and orders
# One advantage per sample, all positive: the loss is about -mean(A) x ratio, far from zero, so a
# relative bound on it compares the backends (random per-token advantages nearly cancel, and the
# bound then measures bf16 noise on a sum close to 0).
ADVANTAGES = [1.0, 0.5, 1.0, 0.75, 1.0, 0.5, 1.0, 0.25]


def _config(path) -> TrainerConfig:
    return TrainerConfig(model=ModelConfig(hf_checkpoint=str(path), dtype="bfloat16"),
                         optimizer=OptimizerConfig(lr=1e-4, clip_grad=1.0),
                         batching=BatchingConfig(max_tokens_per_gpu=256))


def _batch(old=None):
    batch = random_batch(LENGTHS, vocab=(8, 4000), advantages=ADVANTAGES)
    return batch if old is None else batch.with_fields(old_log_probs=[o + 0.05 for o in old])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return tiny_hf("qwen3", tmp_path_factory.mktemp("gpu") / "qwen3", **SHAPE)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """SHAPE's attention with 8 experts of 352 channels each, top 2, in every layer."""
    return tiny_hf("qwen3_moe", tmp_path_factory.mktemp("gpu") / "qwen3_moe", **SHAPE, moe_intermediate_size=352)


def _spawn(world: int, fn, tmp_path: Path, *args) -> dict:
    """Run fn(rank, world, store, result_file, *args) on `world` GPUs; returns rank 0's result."""
    import torch.multiprocessing as mp

    result = tmp_path / f"result-{fn.__name__}.pt"
    store = tmp_path / f"store-{fn.__name__}-{os.getpid()}-{len(list(tmp_path.iterdir()))}"
    mp.start_processes(fn, args=(world, str(store), str(result), *args), nprocs=world, start_method="spawn")
    return torch.load(result, weights_only=False)


def _init(rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def _first_step(rank, world, store, result, hf, tensor, pipeline, sp, expert=1):
    from rlkube_runtime.trainer.megatron.backend import MegatronBackend
    from rlkube_runtime.trainer.megatron.model import ParallelSizes

    _init(rank, world, store)
    backend = MegatronBackend(_config(hf), ParallelSizes(tensor=tensor, pipeline=pipeline, sequence_parallel=sp,
                                                         expert=expert))
    log_probs = backend.log_probs(_batch()).log_probs
    metrics = backend.train_step(_batch(log_probs))
    out = {"metrics": metrics, "log_probs": [t.float().cpu() for t in log_probs]}
    if world == 1:  # the colocated hand-off, on one GPU
        before = torch.cuda.memory_allocated()
        weights = backend.export_weights()
        optimizer_before = _optimizer_tensors(backend)
        # The loop's order: keep the weights for the sync, then give them up too.
        backend.release(keep_weights=True)
        out["kept_weights_equal"] = all(torch.equal(v, weights[k]) for k, v in backend.export_weights().items())
        backend.release()
        out["released_bytes"] = before - torch.cuda.memory_allocated()
        out["params"] = sum(v.numel() for k, v in weights.items() if k != "lm_head.weight")
        out["export_while_released_equal"] = all(torch.equal(v, weights[k]) for k, v in backend.export_weights().items())
        backend.restore()
        optimizer_after = _optimizer_tensors(backend)
        out["optimizer_tensors"] = len(optimizer_before)
        out["optimizer_back_on_gpu"] = all(on_gpu for on_gpu, _ in optimizer_after.values())
        out["optimizer_restored_equal"] = optimizer_before.keys() == optimizer_after.keys() and all(
            torch.equal(optimizer_before[k][1], optimizer_after[k][1]) for k in optimizer_before)
        out["after_resume"] = backend.train_step(_batch(log_probs))
    if rank == 0:
        torch.save(out, result)


def _optimizer_tensors(backend) -> dict:
    """Every tensor the distributed optimizer steps with (fp32 master shards, Adam's moments),
    copied to the host (a device copy would hold the memory the release is measured to free),
    with whether it was on the GPU, keyed by where it sits."""
    out = {}
    for c, chained in enumerate(getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])):
        inner = chained.optimizer
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                out[(c, "param", g, i)] = (p.is_cuda, p.detach().to("cpu", copy=True))
                for key, value in inner.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        out[(c, key, g, i)] = (value.is_cuda, value.to("cpu", copy=True))
    return out


def _torch_first_step(hf):
    from rlkube_runtime.trainer.torch_backend import TorchBackend

    backend = TorchBackend(_config(hf), device="cuda")
    log_probs = backend.log_probs(_batch()).log_probs
    return backend.train_step(_batch(log_probs)), [t.float().cpu() for t in log_probs]


def _assert_same_log_probs(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Per-token log-probs of the same weights and batch in both backends, within bf16 noise."""
    diff = torch.cat([(g - w).abs() for g, w in zip(got, want, strict=True)])
    assert diff.mean() < 0.02 and diff.max() < 0.25, (diff.mean(), diff.max())


def test_one_gpu_bf16_step_matches_the_torch_backend_and_releases_memory(qwen3, tmp_path):
    got = _spawn(1, _first_step, tmp_path, str(qwen3), 1, 1, False)
    want, want_log_probs = _torch_first_step(qwen3)
    _assert_same_log_probs(got["log_probs"], want_log_probs)
    m = got["metrics"]
    assert m["loss"] == pytest.approx(want["loss"], rel=BF16_REL)
    assert m["pg_loss"] == pytest.approx(want["pg_loss"], rel=BF16_REL)
    assert m["grad_norm"] == pytest.approx(want["grad_norm"], rel=5 * BF16_REL)
    assert m["num_micro_batches"] == want["num_micro_batches"] > 1
    # At least the fp32 master weights and both Adam moments (12 bytes a parameter) left the GPU.
    assert got["released_bytes"] >= 12 * got["params"]
    assert got["kept_weights_equal"] and got["export_while_released_equal"]
    # The master shards and both moments of every parameter came back bit for bit, on the GPU.
    assert got["optimizer_tensors"] > 3 * 4 and got["optimizer_back_on_gpu"] and got["optimizer_restored_equal"]
    assert torch.isfinite(torch.tensor(got["after_resume"]["loss"]))


def test_one_gpu_mixture_of_experts_step_matches_the_torch_backend_and_releases_memory(qwen3_moe, tmp_path):
    """megatron-core's MoE layer (all-to-all dispatcher, experts in sequence) in bf16 against HF's
    Qwen3-MoE block under the torch backend: the same log-probs, loss and gradient norm."""
    got = _spawn(1, _first_step, tmp_path, str(qwen3_moe), 1, 1, False)
    want, want_log_probs = _torch_first_step(qwen3_moe)
    _assert_same_log_probs(got["log_probs"], want_log_probs)
    m = got["metrics"]
    assert m["loss"] == pytest.approx(want["loss"], rel=BF16_REL)
    assert m["grad_norm"] == pytest.approx(want["grad_norm"], rel=5 * BF16_REL)
    assert got["released_bytes"] >= 12 * got["params"]
    assert got["kept_weights_equal"] and got["export_while_released_equal"] and got["optimizer_restored_equal"]
    assert torch.isfinite(torch.tensor(got["after_resume"]["loss"]))


@two_gpus
def test_two_gpu_expert_parallel_first_step_matches_one_gpu(qwen3_moe, tmp_path):
    """Experts split over two GPUs (4 each, tokens exchanged all-to-all) take one GPU's step."""
    one = _spawn(1, _first_step, tmp_path, str(qwen3_moe), 1, 1, False)
    two = _spawn(2, _first_step, tmp_path, str(qwen3_moe), 1, 1, False, 2)
    _assert_same_log_probs(two["log_probs"], one["log_probs"])
    for key in ("loss", "pg_loss", "grad_norm"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=BF16_REL), key


@two_gpus
@pytest.mark.parametrize(("tensor", "pipeline", "sp"), [(2, 1, False), (2, 1, True), (1, 2, False)],
                         ids=["tp2", "tp2-sp", "pp2"])
def test_two_gpu_first_step_loss_matches_the_torch_backend(qwen3, tmp_path, tensor, pipeline, sp):
    result = _spawn(2, _first_step, tmp_path, str(qwen3), tensor, pipeline, sp)
    got = result["metrics"]
    want, want_log_probs = _torch_first_step(qwen3)
    _assert_same_log_probs(result["log_probs"], want_log_probs)
    assert got["loss"] == pytest.approx(want["loss"], rel=BF16_REL)
    assert got["pg_loss"] == pytest.approx(want["pg_loss"], rel=BF16_REL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5 * BF16_REL)


def _train_save_then_die(rank, world, store, result, hf, ckpt, k):
    from rlkube_runtime.trainer.megatron.backend import MegatronBackend
    from rlkube_runtime.trainer.megatron.model import ParallelSizes

    _init(rank, world, store)
    backend = MegatronBackend(_config(hf), ParallelSizes(tensor=2))
    for _ in range(k):
        batch = _batch(backend.log_probs(_batch()).log_probs)
        backend.train_step(batch)
    backend.save_distributed(ckpt)
    batch = _batch(backend.log_probs(_batch()).log_probs)
    nxt = backend.train_step(batch)
    if rank == 0:
        torch.save({"next": nxt, "old_log_probs": batch.old_log_probs}, result)
    torch.distributed.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # no clean shutdown: the checkpoint must stand alone


def _resume_and_step(rank, world, store, result, hf, ckpt):
    from rlkube_runtime.trainer.megatron.backend import MegatronBackend
    from rlkube_runtime.trainer.megatron.model import ParallelSizes

    _init(rank, world, store)
    backend = MegatronBackend(_config(hf), ParallelSizes(tensor=2))
    backend.load_distributed(ckpt)
    batch = _batch(backend.log_probs(_batch()).log_probs)
    nxt = backend.train_step(batch)
    if rank == 0:
        torch.save({"next": nxt, "old_log_probs": batch.old_log_probs}, result)


@two_gpus
def test_killed_after_checkpoint_k_a_resumed_tp2_run_takes_the_same_next_step(qwen3, tmp_path):
    import torch.multiprocessing as mp

    ckpt = tmp_path / "ckpt"
    with pytest.raises(mp.ProcessExitedException):
        _spawn(2, _train_save_then_die, tmp_path, str(qwen3), str(ckpt), 2)
    before = torch.load(tmp_path / "result-_train_save_then_die.pt", weights_only=False)
    after = _spawn(2, _resume_and_step, tmp_path, str(qwen3), str(ckpt))
    for a, b in zip(after["old_log_probs"], before["old_log_probs"]):
        assert torch.equal(a, b)  # the restored weights give the very same log-probs
    assert after["next"]["loss"] == before["next"]["loss"]
    assert after["next"]["grad_norm"] == pytest.approx(before["next"]["grad_norm"], rel=1e-6)
    assert after["next"]["lr"] == before["next"]["lr"]
