"""Fixtures of the chaos suite: the job every scenario runs, and one uninterrupted reference run of
it (session scope) that every scenario's figures are compared against."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
for helper_dir in (TESTS / "integration", TESTS / "controlplane", Path(__file__).resolve().parent):
    if str(helper_dir) not in sys.path:
        sys.path.insert(0, str(helper_dir))

from local_runs import start_run, write_local_tiny  # noqa: E402
from chaos_outcome import Outcome, read_outcome  # noqa: E402

NUM_ROLLOUT = 12
CHECKPOINT_INTERVAL = 3  # checkpoints after rollouts 2, 5, 8, 11
# local-tiny (16 prompts x 8 samples, one-token answers) for 12 rollouts; the health check every
# second so a dead engine is found at once; two engine restarts allowed.
JOB = {
    "spec.training.numRollout": NUM_ROLLOUT,
    "spec.checkpoint.interval": CHECKPOINT_INTERVAL,
    "spec.faultTolerance": {
        "healthCheck": {"intervalSeconds": 1, "timeoutSeconds": 10, "firstWaitSeconds": 1},
        "maxEngineRestarts": 2,
    },
}
RUN_TIMEOUT = 300


def chaos_job(tmp_path: Path) -> Path:
    """The scenarios' job file (the same name everywhere: the name is not part of any seed)."""
    return write_local_tiny(tmp_path, "chaos", **JOB)


@dataclass(frozen=True)
class Reference:
    out: Path
    outcome: Outcome
    log: str


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The job run once without interruption."""
    root = tmp_path_factory.mktemp("chaos-reference")
    run = start_run(chaos_job(root), root / "out")
    try:
        code = run.wait(timeout_s=RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == 0, run.output[-4000:]
    outcome = read_outcome(run.out)
    assert sorted(outcome.records) == list(range(NUM_ROLLOUT)), outcome.records.keys()
    assert outcome.last_checkpoint == NUM_ROLLOUT - 1 and outcome.weights_sha256
    return Reference(run.out, outcome, run.output)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory):
    """A control plane of the chaos suite's own (tests/controlplane/harness.py): its scenarios
    restart the API server, which other suites' shared one must not see."""
    from harness import BUILD_COMMAND, ControlPlane, cache_dir, missing_binaries

    missing = missing_binaries()
    if missing:
        pytest.fail(f"control plane binaries missing in {cache_dir() / 'bin'}: {', '.join(missing)}; "
                    f"run `{BUILD_COMMAND}` first", pytrace=False)
    cp = ControlPlane(nodes=2, gpus_per_node=8, logs_dir=tmp_path_factory.mktemp("chaos-controlplane-logs"))
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()
