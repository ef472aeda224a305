"""`rlkube run FILE`: plan, run, and turn whatever ended the run into one line and an exit code."""

from __future__ import annotations

import logging
import os
import sys

from rlkube_runtime.run.plan import RunError, RunMode, prepare_run
from rlkube_runtime.spec.contract import PREEMPTED_EXIT_CODE
from rlkube_runtime.spec.load import SpecError


def run_from_file(
    path: str,
    *,
    output_dir: str | None = None,
    resume: bool = True,
    mode: RunMode = "train",
    load_rollouts: str | None = None,
    dump_all_rollouts: bool = False,
) -> int:
    """Exit 0 on success; a spec or data problem prints one clear error, exit 2; a SIGTERM that
    saved everything, 143; any other failure, its cause and 1."""
    from rlkube_runtime.run.report import report_invalid_spec, write_failure

    logging.basicConfig(level=os.environ.get("RLKUBE_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    # This process and the actors (they inherit the environment) print one progress line per
    # rollout instead of model-loading bars.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not os.environ.get("RAY_ADDRESS"):
        # Ray turns token authentication on for a new local cluster and warns that it did unless
        # RAY_AUTH_MODE is set; saying `token` keeps the protection without the warning. Ray reads
        # it when first imported, so before anything here imports ray. (In a KubeRay cluster the
        # cluster's own setting applies.)
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        plan = prepare_run(
            path, output_dir=output_dir, mode=mode, load_rollouts=load_rollouts, dump_all_rollouts=dump_all_rollouts
        )
    except (SpecError, RunError) as err:
        print(f"rlkube run: {err}", file=sys.stderr)
        report_invalid_spec(err)
        return 2
    backend, why = plan.backend
    print(f"rlkube run: {backend} trainer backend ({why})", file=sys.stderr)
    from rlkube_runtime.run.loop import run_job
    from rlkube_runtime.run.stop import Preempted

    try:
        run_job(plan, resume=resume)
    except RunError as err:  # found once Ray is up (a tracker that cannot start, an unsupported mode)
        print(f"rlkube run: {err}", file=sys.stderr)
        return 2
    except Preempted as stopped:
        print(f"rlkube run: {stopped} `rlkube run {path}` resumes from it.", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except Exception as err:  # noqa: BLE001 - whatever stopped the run, the user gets its cause first
        # Ray hands an actor's error back wrapped in the actor's traceback: the cause goes to the
        # terminal, the whole traceback to a file.
        cause = getattr(err, "cause", None) or err
        full = write_failure(plan.output_dir, err)
        print(
            f"rlkube run: {type(cause).__name__}: {cause}\nThe run stopped; its checkpoints are kept in "
            f"{plan.checkpoint_root} and `rlkube run {path}` resumes from the last one. {full}",
            file=sys.stderr,
        )
        return 1
    return 0
