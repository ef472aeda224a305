import dataclasses
import math

import pytest
import torch

from rlkube_runtime.algorithms import compute_approx_kl, global_counts, policy_objective, value_objective
from rlkube_runtime.algorithms.loss import PolicyLossConfig

D = torch.float64


def _hand_batch():
    """Two samples; old log-probs -1 everywhere, new = old + log(ratio).

    sample 0: ratios [1.1, 1.5], A = +1, mask [1, 1], entropy [1, 2]
    sample 1: ratios [0.5, 2.0, 1.0, 3.0], A = -1, mask [1, 1, 1, 0], entropy [0.5, 0.5, 0.5, 9]
    reference log-probs = new - 0.1 (k1 KL = 0.1 on every token)
    """
    ratios = [[1.1, 1.5], [0.5, 2.0, 1.0, 3.0]]
    old = [torch.full((len(r),), -1.0, dtype=D) for r in ratios]
    new = [(o + torch.log(torch.tensor(r, dtype=D))).requires_grad_(True) for o, r in zip(old, ratios, strict=True)]
    return dict(
        log_probs=new,
        old_log_probs=old,
        advantages=[torch.ones(2, dtype=D), -torch.ones(4, dtype=D)],
        loss_masks=[torch.ones(2), torch.tensor([1.0, 1.0, 1.0, 0.0])],
        entropy=[torch.tensor([1.0, 2.0], dtype=D), torch.tensor([0.5, 0.5, 0.5, 9.0], dtype=D)],
        ref_log_probs=[n.detach() - 0.1 for n in new],
    )


def _objective(**kwargs):
    """`policy_objective` with its settings spelled as keywords beside the tensors, as these tests
    write them: they go into the PolicyLossConfig it takes."""
    names = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    settings = {key: kwargs.pop(key) for key in list(kwargs) if key in names}
    return policy_objective(**kwargs, config=PolicyLossConfig(**settings))


HAND_CONFIG = dict(
    eps_clip=0.2,
    eps_clip_high=0.28,
    use_kl_loss=True,
    kl_loss_coef=0.5,
    kl_loss_type="k1",
    entropy_coef=0.01,
    global_num_samples=2,
    global_num_tokens=5,
)


def test_policy_objective_per_sample_loss_metrics_and_gradient_by_hand():
    # per-token pg losses (clip range [0.8, 1.28]):
    #   s0 (A=+1): r=1.1 -> -1.1; r=1.5 -> -1.28 (clipped)             -> mean -1.19,     clipfrac 1/2
    #   s1 (A=-1): r=0.5 -> 0.8 (clipped); r=2 -> 2.0; r=1 -> 1.0; masked -> mean 3.8/3, clipfrac 1/3
    # pg_loss = (-1.19 + 1.266667) / 2 = 0.038333
    # entropy_loss = ((1 + 2) / 2 + 0.5) / 2 = 1.0; kl_loss = 0.1
    # loss = 0.038333 - 0.01 * 1.0 + 0.5 * 0.1 = 0.078333
    # ppo_kl = (-(ln 1.1 + ln 1.5) / 2 + (ln 2 - ln 2 + 0) / 3) / 2 = -0.125194
    batch = _hand_batch()
    loss, metrics = _objective(**batch, **HAND_CONFIG)
    assert loss.item() == pytest.approx(0.0783333, abs=1e-6)
    assert metrics["loss"].item() == pytest.approx(0.0783333, abs=1e-6)
    assert metrics["pg_loss"].item() == pytest.approx(0.0383333, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx((0.5 + 1 / 3) / 2)
    assert metrics["ppo_kl"].item() == pytest.approx(-(math.log(1.1) + math.log(1.5)) / 4)
    assert metrics["entropy_loss"].item() == pytest.approx(1.0)
    assert metrics["kl_loss"].item() == pytest.approx(0.1)
    assert not any(v.requires_grad for v in metrics.values())
    # d loss / d logp, token weights 1/(2*2) in s0 and 1/(3*2) in s1:
    #   unclipped tokens give -A * r * weight; clipped tokens 0; the k1 KL adds 0.5 * weight on every masked token.
    #   s0: [-1.1/4 + 0.5/4, 0 + 0.5/4] = [-0.15, 0.125]
    #   s1: [0 + 0.5/6, 2/6 + 0.5/6, 1/6 + 0.5/6, 0] = [0.083333, 0.416667, 0.25, 0]
    loss.backward()
    assert batch["log_probs"][0].grad.tolist() == pytest.approx([-0.15, 0.125])
    assert batch["log_probs"][1].grad.tolist() == pytest.approx([1 / 12, 2.5 / 6, 0.25, 0.0])


def test_policy_objective_per_token_reduction_by_hand():
    # pg: (-1.1 - 1.28 + 0.8 + 2.0 + 1.0) / 5 = 0.284; entropy (1 + 2 + 0.5 * 3) / 5 = 0.9; kl 0.1; clipfrac 2/5
    # loss = 0.284 - 0.01 * 0.9 + 0.5 * 0.1 = 0.325
    loss, metrics = _objective(**_hand_batch(), **{**HAND_CONFIG, "per_token_loss": True})
    assert loss.item() == pytest.approx(0.325)
    assert metrics["pg_loss"].item() == pytest.approx(0.284)
    assert metrics["entropy_loss"].item() == pytest.approx(0.9)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.4)


def test_policy_objective_applies_tis_weights_and_reports_the_ratio():
    # rollout = old + [0, -ln 3] in s0 -> ratios old/rollout [1, 3] -> weights [1, 2] (clip 2), clipfrac [0, 1]
    # s1 rollout = old -> weight 1. pg s0 = (-1.1 * 1 + -1.28 * 2) / 2 = -1.83 -> pg_loss = (-1.83 + 1.266667) / 2
    batch = _hand_batch()
    rollout = [batch["old_log_probs"][0] - torch.tensor([0.0, math.log(3)], dtype=D), batch["old_log_probs"][1].clone()]
    _, metrics = _objective(**batch, rollout_log_probs=rollout, **{**HAND_CONFIG, "use_tis": True})
    assert metrics["pg_loss"].item() == pytest.approx((-1.83 + 3.8 / 3) / 2)
    assert metrics["tis"].item() == pytest.approx(((1 + 3) / 2 + 1) / 2)
    assert metrics["tis_clipfrac"].item() == pytest.approx((0.5 + 0) / 2)
    # |old - rollout| = [0, ln 3] in s0 -> (ln 3 / 2 + 0) / 2
    assert metrics["train_rollout_logprob_abs_diff"].item() == pytest.approx(math.log(3) / 4)


def _reference_objective(
    batch, rollout, *, eps_clip, eps_clip_high, eps_clip_c, kl_loss_coef, entropy_coef, tis_clip, n
):
    """The loss written out sample by sample with plain tensor ops (per-sample reduction, low_var_kl, gspo off)."""
    total = 0.0
    for new, old, adv, mask, ent, ref, roll in zip(
        batch["log_probs"],
        batch["old_log_probs"],
        batch["advantages"],
        batch["loss_masks"],
        batch["entropy"],
        batch["ref_log_probs"],
        rollout,
        strict=True,
    ):
        ratio = torch.exp(new - old)
        pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps_clip, 1 + eps_clip_high))
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * eps_clip_c), pg)
        pg = pg * torch.clamp(torch.exp(old - roll), max=tis_clip)
        kl = torch.clamp(torch.exp(ref - new) - 1 - (ref - new), -10, 10)
        per_token = pg - entropy_coef * ent + kl_loss_coef * kl
        total = total + (per_token * mask).sum() / mask.sum().clamp(min=1) / n
    return total


def test_policy_objective_gradient_matches_autograd_of_the_written_formula():
    gen = torch.Generator().manual_seed(3)
    lengths = [4, 7, 2, 5]
    batch = dict(
        log_probs=[(-torch.rand(n, generator=gen, dtype=D) * 2).requires_grad_(True) for n in lengths],
        old_log_probs=[-torch.rand(n, generator=gen, dtype=D) * 2 for n in lengths],
        advantages=[torch.randn(1, generator=gen, dtype=D).expand(n).clone() for n in lengths],
        loss_masks=[(torch.rand(n, generator=gen) > 0.25).to(D) for n in lengths],
        entropy=[torch.rand(n, generator=gen, dtype=D) for n in lengths],
        ref_log_probs=[-torch.rand(n, generator=gen, dtype=D) * 2 for n in lengths],
    )
    rollout = [o + 0.3 * torch.randn(o.shape, generator=gen, dtype=D) for o in batch["old_log_probs"]]
    config = dict(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, kl_loss_coef=0.1, entropy_coef=0.01, tis_clip=2.0)
    loss, _ = _objective(
        **batch,
        rollout_log_probs=rollout,
        use_kl_loss=True,
        use_tis=True,
        global_num_samples=4,
        global_num_tokens=int(sum(m.sum() for m in batch["loss_masks"])),
        **config,
    )
    grads = torch.autograd.grad(loss, batch["log_probs"])
    reference = _reference_objective(batch, rollout, n=4, **config)
    expected = torch.autograd.grad(reference, batch["log_probs"])
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    assert all(torch.allclose(g, e, rtol=1e-10, atol=1e-14) for g, e in zip(grads, expected, strict=True))
    # and autograd agrees with a central finite difference on one coordinate
    h = 1e-6

    def at(delta):
        shifted = [t.detach().clone() for t in batch["log_probs"]]
        shifted[1][2] += delta
        return _reference_objective({**batch, "log_probs": shifted}, rollout, n=4, **config).item()

    assert grads[1][2].item() == pytest.approx((at(h) - at(-h)) / (2 * h), rel=1e-5, abs=1e-9)


def test_policy_objective_is_additive_over_micro_batches_in_every_metric():
    batch = _hand_batch()
    whole_loss, whole = _objective(**batch, **HAND_CONFIG)
    parts = [_objective(**{k: [v[i]] for k, v in batch.items()}, **HAND_CONFIG) for i in range(2)]
    assert sum(loss.item() for loss, _ in parts) == pytest.approx(whole_loss.item())
    for key in whole:
        assert sum(m[key].item() for _, m in parts) == pytest.approx(whole[key].item()), key


def test_gspo_objective_uses_one_ratio_per_sample():
    # s0 masked mean log ratio (ln 1.1 + ln 1.5) / 2 -> ratio sqrt(1.65) = 1.284523 > 1.28
    # -> clipped: loss -1.28 and clipfrac 1 on each token; this micro-batch holds 1 of the 2 global samples -> halved
    batch = _hand_batch()
    config = {**HAND_CONFIG, "use_kl_loss": False, "entropy_coef": 0.0}
    _, metrics = _objective(**{k: [v[0]] for k, v in batch.items()}, estimator="gspo", **config)
    assert metrics["pg_loss"].item() == pytest.approx(-1.28 / 2)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 2)


def test_kl_loss_with_zero_coefficient_is_reported_but_not_differentiated():
    batch = _hand_batch()
    loss, metrics = _objective(**batch, **{**HAND_CONFIG, "kl_loss_coef": 0.0})
    assert metrics["kl_loss"].item() == pytest.approx(0.1)
    loss.backward()
    # without the KL term the s0 gradient is [-1.1/4, 0]
    assert batch["log_probs"][0].grad.tolist() == pytest.approx([-0.275, 0.0])


def test_policy_objective_rejects_bad_configuration():
    batch = _hand_batch()
    with pytest.raises(ValueError, match=r"estimator='dpo'.*grpo, gspo"):
        _objective(**batch, **{**HAND_CONFIG, "estimator": "dpo"})
    with pytest.raises(ValueError, match="use_tis=True needs rollout_log_probs"):
        _objective(**batch, **{**HAND_CONFIG, "use_tis": True})
    with pytest.raises(ValueError, match="kl_loss_type='kl'"):
        _objective(**batch, **{**HAND_CONFIG, "kl_loss_type": "kl"})
    with pytest.raises(ValueError, match=r"advantages\[1\] has 3 tokens"):
        _objective(**{**batch, "advantages": [torch.ones(2), torch.ones(3)]}, **HAND_CONFIG)
    no_ref = {k: v for k, v in batch.items() if k != "ref_log_probs"}
    with pytest.raises(ValueError, match="use_kl_loss=True needs ref_log_probs"):
        _objective(**no_ref, **HAND_CONFIG)


def test_value_objective_by_hand():
    # per-token losses [0.64, 1.0] (see test_clipped_value_loss_by_hand) in one sample -> mean 0.82; clipfrac 0.5
    masks = [torch.ones(2)]
    n, t = global_counts(masks)
    loss, metrics = value_objective(
        values=[torch.tensor([1.0, 2.0], requires_grad=True)],
        old_values=[torch.tensor([0.5, 2.0])],
        returns=[torch.tensor([1.5, 1.0])],
        loss_masks=masks,
        value_clip=0.2,
        global_num_samples=n,
        global_num_tokens=t,
    )
    assert loss.item() == pytest.approx(0.82)
    assert metrics == {"value_loss": pytest.approx(0.82), "value_clipfrac": pytest.approx(0.5)}


def test_kl_used_in_the_objective_is_compute_approx_kl():
    batch = _hand_batch()
    _, metrics = _objective(**batch, **{**HAND_CONFIG, "kl_loss_type": "k2"})
    # k2 = 0.1^2 / 2 = 0.005 on every token
    assert metrics["kl_loss"].item() == pytest.approx(
        compute_approx_kl(torch.tensor(0.1), torch.tensor(0.0), "k2").item()
    )
