"""Per-token KL estimators between the current policy and a reference (Schulman, "Approximating KL").

With log_ratio = log p(x) - log q(x) for tokens x sampled from p:
  k1 = log_ratio                                (unbiased, can be negative)
  k2 = log_ratio^2 / 2                          (biased, low variance)
  k3 = exp(-log_ratio) - 1 + log_ratio          (unbiased, non-negative; "low_var_kl")
Following slime (`slime/utils/ppo_utils.py::compute_approx_kl`), only the name "low_var_kl" is
clamped to [-10, 10] for numerical safety; "k3" is the same estimator unclamped.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ._common import as_float, lookup

LOW_VAR_KL_CLAMP = 10.0


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return log_ratio.square() / 2.0


def _k3(log_ratio: Tensor) -> Tensor:
    # In terms of r = q/p = exp(-log_ratio): r - 1 - log r >= 0.
    neg = -log_ratio
    return neg.exp() - 1.0 - neg


def _low_var_kl(log_ratio: Tensor) -> Tensor:
    return _k3(log_ratio).clamp(min=-LOW_VAR_KL_CLAMP, max=LOW_VAR_KL_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _low_var_kl,
}


def compute_approx_kl(log_probs: Tensor, ref_log_probs: Tensor, kl_type: str) -> Tensor:
    """Per-token approximate KL(current || reference).

    Args:
        log_probs: [...] log-probs of the sampled tokens under the current policy.
        ref_log_probs: [...] the same tokens under the reference policy (same shape).
        kl_type: one of `KL_ESTIMATORS` ("k1", "k2", "k3", "low_var_kl").

    Returns:
        [...] per-token KL estimate, float32 or float64 (bf16/fp16 inputs are upcast to float32).
    """
    estimator = lookup(KL_ESTIMATORS, kl_type, "kl_type")
    return estimator(as_float(log_probs) - as_float(ref_log_probs))
