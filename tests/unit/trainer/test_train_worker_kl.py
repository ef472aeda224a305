"""reinforce++ with a KL penalty in its rewards (klCoef) and no KL loss: the worker loads the
reference model for it, and the penalty changes the update once the policy has left the reference."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from rlkube_runtime.data.sample import Sample
from rlkube_runtime.actors.trainer import TrainerWorker

LOCAL_TINY = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "local-tiny.yaml"


def _worker(checkpoint, kl_coef: float) -> TrainerWorker:
    spec = yaml.safe_load(LOCAL_TINY.read_text())["spec"]
    spec["algorithm"] = {"advantageEstimator": "reinforce_plus_plus", "klCoef": kl_coef}
    spec["rollout"].update(batchSize=2, nSamplesPerPrompt=2)
    spec["training"].update(globalBatchSize=4)
    return TrainerWorker(spec, hf_checkpoint=str(checkpoint))


def _samples() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        tokens = torch.randint(8, 60, (9,), generator=g).tolist()
        samples.append(Sample(index=i, group_index=i // 2, tokens=tokens, response_length=4, reward=float(i % 2)).to_dict())
    return samples


def test_kl_coef_alone_loads_the_reference_and_shapes_the_update(tiny_checkpoint):
    with_kl, without = _worker(tiny_checkpoint, 0.5), _worker(tiny_checkpoint, 0.0)
    assert with_kl.backend.ref_model is not None and without.backend.ref_model is None
    samples = _samples()
    # Step 1: the policy is the reference, so the penalty is zero and both updates agree.
    first = [w.train(0, samples) for w in (with_kl, without)]
    assert first[0]["train/pg_loss"] == first[1]["train/pg_loss"]
    # Step 2: the policy has moved; the per-token KL now lowers the rewards of the KL run.
    second = [w.train(1, samples) for w in (with_kl, without)]
    assert second[0]["train/pg_loss"] != second[1]["train/pg_loss"]


def test_the_reference_takes_the_policy_weights_after_every_n_th_rollout(tiny_checkpoint):
    """training.refUpdateInterval 2: the reference is the initial model through rollout 1 and the
    policy of rollout 2 (index 1) after it."""
    spec = yaml.safe_load(LOCAL_TINY.read_text())["spec"]
    spec["algorithm"] = {"useKlLoss": True, "klLossCoef": 0.1}
    spec["rollout"].update(batchSize=2, nSamplesPerPrompt=2)
    spec["training"].update(globalBatchSize=4, refUpdateInterval=2)
    worker = TrainerWorker(spec, hf_checkpoint=str(tiny_checkpoint))
    initial = {k: v.clone() for k, v in worker.backend.ref_model.state_dict().items()}
    samples = _samples()
    worker.train(0, samples)
    assert all(torch.equal(v, initial[k]) for k, v in worker.backend.ref_model.state_dict().items())
    worker.train(1, samples)
    assert worker.backend.ref_refreshed
    policy, ref = worker.backend.model.state_dict(), worker.backend.ref_model.state_dict()
    assert all(torch.equal(v, policy[k]) for k, v in ref.items())
    assert any(not torch.equal(v, initial[k]) for k, v in ref.items())
    # Rollout 3 starts from a reference equal to the policy: its KL loss is zero.
    assert worker.train(2, samples)["train/kl_loss"] == 0.0
