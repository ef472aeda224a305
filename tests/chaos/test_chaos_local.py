"""Chaos on a local run: a process of the job is killed (or its disk fills, or its checkpoint is
damaged) at a chosen point, the job recovers, and what it trained is compared, tolerating nothing,
with the uninterrupted reference run (conftest.reference): no prompt group lost, none trained
twice, the same samples per rollout, the same final weights byte for byte. Each scenario records
its figures (tests/chaos/chaos_outcome.py) for the README's table; recovery times are wall-clock seconds
on the machine running the suite, recorded there and not asserted: on a loaded 2-core machine they
vary by a factor of two (a correct resume once took 103 s), so a bound would fail by chance.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CHECKPOINT_INTERVAL, NUM_ROLLOUT, RUN_TIMEOUT, Reference, chaos_job
from local_runs import LocalRun, read_jsonl, start_run
from chaos_outcome import compare, read_outcome, record_figures

pytestmark = [pytest.mark.slow]

ENGINE_RESTARTS_JOURNAL = "engine_restarts.jsonl"
RESUMING = "resuming from checkpoint "


# --- finding the run's processes and the moment to strike --------------------------------------


def _cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def engine_pids(out: Path) -> list[int]:
    """Built-in engine processes of the run writing to `out` (their model path is under it)."""
    return [
        int(p.name) for p in Path("/proc").iterdir()
        if p.name.isdigit() and "rlkube_runtime.engine" in (args := _cmdline(int(p.name)))
        and any(str(out) in a for a in args)
    ]


def session_pids(run: LocalRun, marker: str) -> list[int]:
    """Processes of the run's session (the driver and its Ray workers) whose title has `marker`."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,sid="], check=True, capture_output=True, text=True).stdout
    return [
        int(pid) for pid, sid in (line.split() for line in table.splitlines())
        if sid == str(run.proc.pid) and marker in " ".join(_cmdline(int(pid)))
    ]


def rollouts_logged(run: LocalRun) -> int:
    return len(read_jsonl(run.out / "metrics.jsonl"))


def engine_log_size(out: Path) -> int:
    return sum(p.stat().st_size for p in (out / "logs").glob("engine-*.log"))


def wait_for_generation(run: LocalRun, after_rollouts: int) -> None:
    """Until rollout `after_rollouts` is being generated: `after_rollouts` rollouts are logged and
    then the engine writes (it logs only while batching requests, i.e. mid-rollout)."""
    run.wait_until(lambda: rollouts_logged(run) >= after_rollouts, f"{after_rollouts} rollouts", RUN_TIMEOUT)
    size = engine_log_size(run.out)
    deadline = time.monotonic() + 30
    while engine_log_size(run.out) == size:
        assert time.monotonic() < deadline and run.running(), "the engine logged no batch after the rollout"
        time.sleep(0.005)


def finish(run: LocalRun) -> int:
    try:
        return run.wait(timeout_s=RUN_TIMEOUT)
    finally:
        run.kill()


def resume_and_time(job: Path, out: Path) -> tuple[LocalRun, float]:
    """Start the job again on `out`; (the run, seconds until it trained a rollout again)."""
    before = len(read_jsonl(out / "samples.jsonl"))
    started = time.monotonic()
    run = start_run(job, out)
    run.wait_until(lambda: len(read_jsonl(out / "samples.jsonl")) > before, "a rollout trained again", RUN_TIMEOUT)
    return run, time.monotonic() - started


def assert_as_reference(figures: dict) -> None:
    assert figures["groups_lost"] == 0 and figures["samples_lost"] == 0, figures
    assert figures["groups_trained_twice"] == 0 and figures["samples_trained_twice"] == 0, figures
    assert figures["samples_as_reference"] and figures["weight_versions_as_reference"], figures
    assert figures["weights_as_reference"], figures


# --- the scenarios ----------------------------------------------------------------------------


def test_control_an_uninterrupted_rerun_equals_the_reference(reference: Reference, tmp_path):
    """The suite's premise: two runs of the job are the same, byte for byte."""
    run = start_run(chaos_job(tmp_path), tmp_path / "out")
    assert finish(run) == 0, run.output[-4000:]
    figures = compare(reference.outcome, read_outcome(run.out))
    record_figures("control: uninterrupted rerun", figures)
    assert_as_reference(figures)
    assert figures["rollouts_redone"] == 0


def test_engine_sigkill_mid_rollout_is_replaced_with_the_current_weights(reference: Reference, tmp_path):
    run = start_run(chaos_job(tmp_path), tmp_path / "out")
    try:
        wait_for_generation(run, after_rollouts=4)
        [engine] = engine_pids(run.out)
        killed_at = time.time()
        os.kill(engine, signal.SIGKILL)
        code = finish(run)
    finally:
        run.kill()
    assert code == 0, run.output[-4000:]
    [joined] = read_jsonl(run.out / "logs" / ENGINE_RESTARTS_JOURNAL)
    figures = {
        **compare(reference.outcome, read_outcome(run.out)),
        "engine_restarts": 1,
        "engine_serving_again_s": round(joined["joined_at"] - killed_at, 2),
        "joined_rollout": joined["rollout"],
        "joined_weight_version": joined["weight_version"],
    }
    record_figures("engine SIGKILL mid-rollout", figures)
    assert_as_reference(figures)
    assert figures["rollouts_redone"] == 0
    # The replacement joined the router holding the trainer's latest weights: the version synced
    # before the rollout it joined in (the sync before rollout k sets version k).
    assert joined["weight_version"] == joined["synced_version"] == str(joined["rollout"]), joined
    assert joined["rollout"] >= 4
    assert engine_pids(run.out) == []


def test_engine_sigkill_mid_weight_sync_is_replaced_with_the_weights_being_synced(reference: Reference, tmp_path):
    # The engine kills itself as version 6 arrives (after the sync paused and flushed it): a fail
    # point (rlkube_runtime.failpoints), since the whole push takes a fraction of a second.
    version, marker = "6", tmp_path / "failpoint-fired"
    env = {"RLKUBE_FAILPOINTS": json.dumps({f"engine.update_weights:{version}": str(marker)})}
    run = start_run(chaos_job(tmp_path), tmp_path / "out", env=env)
    assert finish(run) == 0, run.output[-4000:]
    assert marker.exists(), "the fail point never fired"
    [joined] = read_jsonl(run.out / "logs" / ENGINE_RESTARTS_JOURNAL)
    figures = {
        **compare(reference.outcome, read_outcome(run.out)),
        "engine_restarts": 1,
        "engine_serving_again_s": round(joined["joined_at"] - marker.stat().st_mtime, 2),
        "joined_rollout": joined["rollout"],
        "joined_weight_version": joined["weight_version"],
    }
    record_figures("engine SIGKILL mid-weight-sync", figures)
    assert_as_reference(figures)
    assert figures["rollouts_redone"] == 0
    # It joined holding the version whose sync it died in, the trainer's latest.
    assert joined["weight_version"] == joined["synced_version"] == version, joined


def test_trainer_sigkill_mid_step_fails_the_attempt_and_the_next_resumes(reference: Reference, tmp_path):
    job, out = chaos_job(tmp_path), tmp_path / "out"
    run = start_run(job, out)
    try:
        wait_for_generation(run, after_rollouts=4)  # after the checkpoint of rollout 2
        [trainer] = session_pids(run, "ray::TrainerWorker")
        os.kill(trainer, signal.SIGKILL)
        code = run.wait(timeout_s=RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == 1, run.output[-4000:]
    assert "The run stopped; its checkpoints are kept" in run.output
    resumed, training_again = resume_and_time(job, out)
    assert finish(resumed) == 0, resumed.output[-4000:]
    figures = {**compare(reference.outcome, read_outcome(out)), "attempt_training_again_s": round(training_again, 2),
               "resumed_from": _resumed_from(resumed.output)}
    record_figures("trainer SIGKILL mid-step -> resume", figures)
    assert_as_reference(figures)
    assert figures["resumed_from"] % CHECKPOINT_INTERVAL == CHECKPOINT_INTERVAL - 1


def test_driver_sigkill_mid_step_loses_nothing_on_resume(reference: Reference, tmp_path):
    job, out = chaos_job(tmp_path), tmp_path / "out"
    run = start_run(job, out)
    try:
        wait_for_generation(run, after_rollouts=5)
        run.kill()  # the driver and every process of its session, as a node loss would
    finally:
        run.kill()
    assert run.proc.returncode == -signal.SIGKILL
    # The engines (sessions of their own) die with their launcher: nothing of the lost run is
    # left holding a port or a GPU when the next attempt starts.
    deadline = time.monotonic() + 15
    while engine_pids(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = engine_pids(out)
    resumed, training_again = resume_and_time(job, out)
    assert finish(resumed) == 0, resumed.output[-4000:]
    figures = {**compare(reference.outcome, read_outcome(out)), "attempt_training_again_s": round(training_again, 2),
               "resumed_from": _resumed_from(resumed.output)}
    figures["orphan_engines"] = len(orphans)
    record_figures("driver SIGKILL mid-step -> resume", figures)
    assert orphans == []
    assert_as_reference(figures)


def test_sigterm_mid_rollout_saves_exits_143_and_resumes_with_nothing_redone(reference: Reference, tmp_path):
    job, out = chaos_job(tmp_path), tmp_path / "out"
    run = start_run(job, out)
    try:
        wait_for_generation(run, after_rollouts=4)
        os.kill(run.proc.pid, signal.SIGTERM)
        stopped_at = time.monotonic()
        code = run.wait(timeout_s=120)
        stop_seconds = time.monotonic() - stopped_at
    finally:
        run.kill()
    assert code == 143, run.output[-4000:]
    assert "stopped by SIGTERM" in run.output
    saved = read_outcome(out)
    # Everything trained is in the checkpoint: the SIGTERM run left no trained rollout uncovered.
    assert saved.last_checkpoint == max(saved.records), (saved.last_checkpoint, sorted(saved.records))
    resumed, training_again = resume_and_time(job, out)
    assert finish(resumed) == 0, resumed.output[-4000:]
    figures = {**compare(reference.outcome, read_outcome(out)), "stop_after_sigterm_s": round(stop_seconds, 2),
               "attempt_training_again_s": round(training_again, 2), "resumed_from": _resumed_from(resumed.output)}
    record_figures("driver SIGTERM mid-rollout -> checkpoint -> resume", figures)
    assert_as_reference(figures)
    assert figures["rollouts_redone"] == 0  # SIGTERM costs no work


def test_damaged_latest_checkpoints_are_skipped_with_a_warning_and_the_newest_intact_one_used(
    reference: Reference, tmp_path
):
    """The newest checkpoint corrupt (a flipped byte, same size) and the one before it half-written
    (the file cut short): both are skipped, each with a warning naming the file and the reason,
    and the job resumes from the third newest and ends as the reference did."""
    out = tmp_path / "out"
    shutil.copytree(reference.out, out)
    checkpoints = out / "checkpoints"
    corrupt = checkpoints / f"rollout_{NUM_ROLLOUT - 1:08d}"
    half = checkpoints / f"rollout_{NUM_ROLLOUT - 1 - CHECKPOINT_INTERVAL:08d}"
    data = bytearray((corrupt / "trainer_state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (corrupt / "trainer_state.pt").write_bytes(bytes(data))
    whole = (half / "trainer_state.pt").read_bytes()
    (half / "trainer_state.pt").write_bytes(whole[: len(whole) // 2])

    run = start_run(chaos_job(tmp_path), out)
    assert finish(run) == 0, run.output[-4000:]
    intact = NUM_ROLLOUT - 1 - 2 * CHECKPOINT_INTERVAL
    figures = {**compare(reference.outcome, read_outcome(out)), "resumed_from": _resumed_from(run.output)}
    record_figures("corrupt + half-written latest checkpoints -> newest intact one", figures)
    assert f"skipping checkpoint {corrupt}: trainer_state.pt sha256 " in run.output, run.output[-3000:]
    assert f"skipping checkpoint {half}: trainer_state.pt has {len(whole) // 2} bytes, manifest says {len(whole)}" in run.output
    assert figures["resumed_from"] == intact
    assert_as_reference(figures)
    assert figures["rollouts_redone"] == 2 * CHECKPOINT_INTERVAL  # the rollouts after the intact checkpoint


def _resumed_from(output: str) -> int:
    [line] = [line for line in output.splitlines() if line.startswith(RESUMING)]
    return int(line.rsplit("(rollout ", 1)[1].rstrip(")"))


@pytest.fixture
def small_volume(tmp_path):
    """A 64 MiB tmpfs standing for the job's checkpoint volume (needs root); unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", str(volume)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield volume
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)


def fill(volume: Path, leave_bytes: int) -> Path:
    """Take all the volume's free space but `leave_bytes`."""
    filler = volume / "filler"
    free = shutil.disk_usage(volume).free
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(free - leave_bytes, 0))
    return filler


def test_a_full_disk_during_a_save_stops_the_run_naming_the_cause_and_keeps_the_older_checkpoints(
    reference: Reference, tmp_path, small_volume
):
    from rlkube_runtime.trainer.checkpoint import list_checkpoints, verify_checkpoint

    job, out = chaos_job(tmp_path), small_volume / "out"
    run = start_run(job, out)
    try:
        first = CHECKPOINT_INTERVAL - 1
        run.wait_until(lambda: [i for i, _ in list_checkpoints(out / "checkpoints")] == [first],
                       f"the checkpoint of rollout {first}", RUN_TIMEOUT)
        # Room for a few rollouts' logs and records, not for the next checkpoint (about 1 MB).
        filler = fill(small_volume, leave_bytes=400 * 1024)
        code = run.wait(timeout_s=RUN_TIMEOUT)
    finally:
        run.kill()
    output = run.output
    assert code == 1, output[-4000:]
    checkpoints = out / "checkpoints"
    failed = first + CHECKPOINT_INTERVAL
    assert (f"rlkube run: CheckpointSaveError: could not save the checkpoint of rollout {failed} in {checkpoints}: "
            "No space left on device") in output, output[-3000:]
    assert f"the checkpoints saved before are intact (newest: rollout {first}," in output
    assert "Traceback" not in output
    # The older checkpoint verifies; the partial save is gone.
    assert [i for i, _ in list_checkpoints(checkpoints)] == [first]
    verify_checkpoint(checkpoints / f"rollout_{first:08d}")
    assert [p.name for p in checkpoints.iterdir() if p.name.startswith(".tmp-")] == []

    filler.unlink()  # space freed: the job resumes and ends as the reference did
    resumed, training_again = resume_and_time(job, out)
    assert finish(resumed) == 0, resumed.output[-4000:]
    figures = {**compare(reference.outcome, read_outcome(out)), "resumed_from": _resumed_from(resumed.output),
               "attempt_training_again_s": round(training_again, 2)}
    record_figures("disk full during a save -> clear error -> resume", figures)
    assert figures["resumed_from"] == first
    assert_as_reference(figures)
