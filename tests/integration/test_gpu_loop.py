"""The loop on a GPU at a size where weight sync is real work: a ~113M-parameter model in bf16,
a weight sync after every rollout, colocated on one GPU (CUDA IPC) and separate on two (NCCL),
with the torch and the megatron trainer backends.
Skipped without CUDA; run on the GPU machine before a change to the engine, the trainer or
weight sync is called done."""

from __future__ import annotations

import pytest
import torch
from local_runs import read_jsonl, start_run, write_local_tiny
from safetensors import safe_open

from rlkube_runtime.tiny.model import build_tiny_checkpoint
from rlkube_runtime.tiny.task import get_task

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROLLOUTS = 5


@pytest.fixture(scope="module")
def model_100m(tmp_path_factory):
    out = build_tiny_checkpoint(
        tmp_path_factory.mktemp("llama-113m"), alphabet=get_task("digit-successor").alphabet,
        hidden_size=1024, num_layers=12, num_heads=16,
    )
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    count = sum(torch.Size(shape).numel() for shape in sizes.values())
    assert count >= 100_000_000, count
    return out, count


@pytest.mark.parametrize("backend", ["torch", "megatron"])
@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_every_rollout_is_generated_by_the_weights_synced_just_before_it(tmp_path, model_100m, placement, backend):
    if placement == "separate" and torch.cuda.device_count() < 2:
        pytest.skip("separate placement needs two GPUs")
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")
    model_dir, params = model_100m
    job = write_local_tiny(
        tmp_path, f"gpu-{placement}",
        **{
            "spec.model": {"hfCheckpoint": str(model_dir), "dtype": "bfloat16"},
            "spec.training.numRollout": ROLLOUTS,
            "spec.training.backend": backend,
            "spec.training.optimizer": {"lr": 1e-5},
            "spec.rollout.maxResponseLen": 8,
            "spec.resources.placement": placement,
            **({"spec.resources.rollout": {"gpus": 1}} if placement == "separate" else {}),
        },
    )
    out = tmp_path / "out"
    run = start_run(job, out)
    try:
        returncode = run.wait(timeout_s=600)
    finally:
        run.kill()
    assert returncode == 0, run.output[-5000:]

    records = [m for m in read_jsonl(out / "metrics.jsonl") if m["rollout"] >= 0]
    assert len(records) == ROLLOUTS
    for m in records:
        # bf16 weights, each tensor once: 2 bytes a parameter (the char vocabulary's head is untied).
        assert m["perf/update_weights_bytes"] == 2 * params
        assert m["perf/update_weights_time"] > 0
    versions = {r["rollout"]: r["weight_versions"] for r in read_jsonl(out / "samples.jsonl")}
    assert versions[0] == ["default"]
    assert all(versions[k] == [str(k)] for k in range(1, ROLLOUTS)), versions
