"""`rlkube run`: the training run, one module per idea.

    plan.py         spec -> RunPlan: everything the spec, data or dumps can fail on, before Ray
    cluster.py      Ray, the topology and the actors placed on it (a TrainerGroup, a RolloutGroup)
    loop.py         the loop: generate -> train -> sync -> dump -> eval -> save -> report
    handoff.py      colocated: trainer and engines taking turns with the device memory
    checkpoints.py  save and resume
    report.py       metrics, status, trackers, dumps, the end-of-run block
    stop.py         SIGTERM: stop at the next checkpoint-safe point
    main.py         `rlkube run FILE` and its exit codes

Locally `ray.init()` starts a private Ray; inside a KubeRay cluster (RAY_ADDRESS set by the
RayJob) the same code joins the existing cluster. Two debugging modes split the loop at the
rollout dump (slime's --debug-rollout-only and --debug-train-only): `rollout-only` generates and
dumps every sample, starting no trainer; `train-only` trains on such dumps, starting no engine.
Neither writes checkpoints. Only the CLI imports this package.
"""

from rlkube_runtime.run.main import run_from_file

__all__ = ["run_from_file"]
