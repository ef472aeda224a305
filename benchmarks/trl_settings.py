"""The GRPOConfig settings both TRL benchmarks share: TRL configured to do what rlkube's job does,
where TRL's defaults differ (one optimizer step per rollout, no KL term, no recompute, rlkube's
AdamW and clipping, per-sample loss, group-normalised rewards)."""

from __future__ import annotations


def grpo_settings(*, rollouts: int, lr: float, n_samples: int, max_response_len: int, seed: int) -> dict:
    """GRPOConfig keywords; the caller adds output_dir, device/precision and batch sizes."""
    return dict(
        gradient_checkpointing=False,  # GRPOConfig defaults to True; rlkube's recompute defaults to none
        num_generations=n_samples,
        max_completion_length=max_response_len,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_steps=rollouts,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.0,  # no KL term (rlkube: useKlLoss false), so no reference model
        epsilon=0.2,
        loss_type="grpo",  # mean over each sample's tokens, then over samples (rlkube: perTokenLoss false)
        scale_rewards="group",  # (r - mean) / std within the group (rlkube: grpoStdNormalization true)
        num_iterations=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
