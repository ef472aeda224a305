"""The SGLang and sglang-router launch lines rlkube builds for the example RLJobs in manifests/examples/.

Built by production code, not copied from it: the job's topology (`plan_topology`), each engine's
actor arguments (`engine_actor_options`, what the rollout manager passes), the actor's
`start_engine` arguments (`EngineActor.launch_options`) and the launcher's `engine_command`. Only
what a cluster decides at run time is filled in here: the pod IP, the free ports and the model
path (the driver passes hfCheckpoint through, or the checkpoint it resumes from).

`python tests/unit/engine/example_launch_lines.py` prints the README's "production" block;
test_sglang_conformance.py checks that the README still shows exactly that.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shlex

from rlkube_runtime.actors.engine import EngineActor, engine_actor_options
from rlkube_runtime.serving.launch import engine_command, engine_launch_spec
from rlkube_runtime.serving.router import RouterProcess
from rlkube_runtime.serving.sglang_args import SGLangServerConfig, engine_nodes, sglang_server_args
from rlkube_runtime.spec import RLJob, load_rljob
from rlkube_runtime.topology import plan_topology

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "manifests" / "examples"
README = ROOT / "README.md"
FIRST_PORT = 30000


@dataclasses.dataclass(frozen=True)
class EngineLine:
    job: str
    placement: str
    index: int
    argv: list[str]  # after `python -m sglang.launch_server`


def example_jobs() -> list[RLJob]:
    return [load_rljob(path) for path in sorted(EXAMPLES.glob("*.yaml"))]


def sglang_jobs() -> list[RLJob]:
    return [job for job in example_jobs() if _value(job.spec.rollout.engine) == "sglang"]


def engine_lines(job: RLJob, *, host_of=lambda j: f"10.0.0.{j + 1}") -> list[EngineLine]:
    """Every engine's SGLang arguments for `job`, engine j at `host_of(j)`, ports from FIRST_PORT."""
    spec = job.spec
    topology = _topology(job)
    lines = []
    for j in range(topology.num_engines):
        arguments = engine_actor_options(spec, j, model_path=spec.model.hf_checkpoint, log_dir="/tmp/logs", device="cuda")
        actor = EngineActor(**arguments, host=host_of(j))
        launch = engine_launch_spec(actor.launch_options())
        command = engine_command(launch, FIRST_PORT + 2 * j, nccl_port=FIRST_PORT + 2 * j + 1)
        assert command[1:3] == ["-m", "sglang.launch_server"], command
        lines.append(EngineLine(job.metadata.name, topology.placement, j, command[3:]))
    return lines


def multi_node_lines() -> list[list[str]]:
    """A synthetic engine of 16 GPUs on pods of 8 (not yet launchable by rlkube: see the README):
    one line per node, meeting at node 0."""
    nodes = engine_nodes(16, 8, head_address="10.0.1.1", dist_port=29600)
    return [
        sglang_server_args(SGLangServerConfig(
            model_path="/data/models/Qwen3-235B-A22B", host=f"10.0.1.{rank + 1}", port=FIRST_PORT, nccl_port=FIRST_PORT + 1,
            tp_size=16, seed=1234, dtype="bfloat16", node=node,
        ))
        for rank, node in enumerate(nodes)
    ]


def router_lines(tmp_dir: str) -> list[tuple[str, list[str], list[str]]]:
    """(job, router arguments, worker URLs) for each example job: the router built as the rollout
    manager builds it, in front of the job's engines."""
    lines = []
    for job in example_jobs():
        urls = [f"http://10.0.0.{j + 1}:{FIRST_PORT + 2 * j}" for j in range(_topology(job).num_engines)]
        router = RouterProcess(worker_urls=urls, log_dir=tmp_dir, model_path=tmp_dir,  # an existing (local) path
                               router_args=dict(job.spec.rollout.router_args), port=8000, prometheus_port=29000)
        command = router.command()
        assert command[1:3] == ["-m", "rlkube_runtime.serving.router_main"], command
        lines.append((job.metadata.name, command[3:], urls))
    return lines


def readme_block() -> str:
    """The README's production block: engine 0 of each example job that runs SGLang."""
    parts = []
    for job in sglang_jobs():
        line = engine_lines(job, host_of=lambda j: "$POD_IP")[0]
        command = shlex.join(["python", "-m", "sglang.launch_server", *line.argv]).replace("'$POD_IP'", "$POD_IP")
        parts.append(f"# {line.job} ({line.placement}): engine 0 of {_topology(job).num_engines}\n{_wrap(command)}")
    return "```bash\n" + "\n\n".join(parts) + "\n```"


def _topology(job: RLJob):
    """The job's topology on a cluster that has exactly the GPUs it asks for."""
    res = job.spec.resources
    placement = _value(res.placement)
    trainer_gpus = res.trainer.nodes * res.trainer.gpus_per_node
    gpus = trainer_gpus if placement == "colocated" else trainer_gpus + res.rollout.gpus
    return plan_topology(
        placement=placement, trainer_nodes=res.trainer.nodes, trainer_gpus_per_node=res.trainer.gpus_per_node,
        rollout_gpus=res.rollout.gpus, gpus_per_engine=job.spec.rollout.gpus_per_engine, visible_gpus=gpus, cpus=64,
    )


def _wrap(command: str, width: int = 100) -> str:
    """Break a long command before its flags, shell-style."""
    lines, current = [], ""
    for token in command.split(" --"):
        piece = token if not current and not lines else "--" + token
        if current and len(current) + 1 + len(piece) > width:
            lines.append(current)
            current = "    " + piece
        else:
            current = f"{current} {piece}" if current else piece
    lines.append(current)
    return " \\\n".join(lines)


def _value(field) -> str:
    return str(getattr(field, "value", field))


if __name__ == "__main__":
    print(readme_block())
