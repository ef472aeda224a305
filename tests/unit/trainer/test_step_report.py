"""What a train step reports (trainer/backend.py StepReport): its loss metrics, the norm and lr,
and the skipped-step flag, read as the mapping the trainer actor averages."""

from __future__ import annotations

import math

from rlkube_runtime.trainer.backend import StepReport


def test_a_step_report_reads_as_its_metrics_then_norm_lr_and_skipped_flag():
    report = StepReport({"loss": 0.5, "num_micro_batches": 2.0}, grad_norm=1.25, lr=1e-6)
    assert dict(report) == {"loss": 0.5, "num_micro_batches": 2.0, "grad_norm": 1.25, "lr": 1e-6, "skipped_step": 0.0}
    assert report == {"loss": 0.5, "num_micro_batches": 2.0, "grad_norm": 1.25, "lr": 1e-6, "skipped_step": 0.0}
    assert report["grad_norm"] == 1.25 and not report.skipped


def test_a_non_finite_norm_marks_the_step_skipped():
    for norm in (math.inf, math.nan):
        report = StepReport({"loss": 0.0}, grad_norm=norm, lr=0.0)
        assert report.skipped and report["skipped_step"] == 1.0
