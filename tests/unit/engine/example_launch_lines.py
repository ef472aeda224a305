"""The SGLang and sglang-router launch lines rlkube builds for the example RLJobs in manifests/examples/.

Built by production code, not copied from it: the job's topology (`plan_topology`), each engine's
actor arguments (`engine_actor_options`, what the rollout manager passes), the actor's
`start_engine` arguments (`EngineActor.launch_options`, as each node of its engine: `engine_nodes`,
what `EngineGroup` gives them) and the launcher's `engine_command`. Only what a cluster decides at
run time is filled in here: the pod IPs, the free ports (node 0's `DIST_PORT` where the nodes of an
engine meet) and the model path (the driver passes hfCheckpoint through, or the checkpoint it
resumes from).

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
from rlkube_runtime.serving.sglang_args import engine_nodes
from rlkube_runtime.spec import RLJob, load_rljob
from rlkube_runtime.topology import plan_topology

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "manifests" / "examples"
README = ROOT / "README.md"
FIRST_PORT = 30000
DIST_PORT = 29600


@dataclasses.dataclass(frozen=True)
class EngineLine:
    job: str
    placement: str
    index: int
    node: int  # its node of the engine (rollout.nodesPerEngine)
    argv: list[str]  # after `python -m sglang.launch_server`


def example_jobs() -> list[RLJob]:
    return [load_rljob(path) for path in sorted(EXAMPLES.glob("*.yaml"))]


def sglang_jobs() -> list[RLJob]:
    return [job for job in example_jobs() if _value(job.spec.rollout.engine) == "sglang"]


def pod_ip(j: int, k: int, nodes_per_engine: int) -> str:
    """The IP of node k of engine j: each node on a pod of its own."""
    return f"10.0.0.{j * nodes_per_engine + k + 1}"


def engine_lines(job: RLJob, *, host_of=pod_ip) -> list[EngineLine]:
    """Every engine node's SGLang arguments for `job`, node k of engine j at `host_of(j, k, nodes)`,
    ports from FIRST_PORT (two per engine, the same on each of its pods)."""
    spec = job.spec
    topology = _topology(job)
    nnodes = spec.rollout.nodes_per_engine
    lines = []
    for j in range(topology.num_engines):
        nodes = engine_nodes(nnodes, f"{host_of(j, 0, nnodes)}:{DIST_PORT}")
        for k, node in enumerate(nodes):
            arguments = engine_actor_options(spec, j, model_path=spec.model.hf_checkpoint, log_dir="/tmp/logs",
                                             device="cuda", node_rank=k)
            actor = EngineActor(**arguments, host=host_of(j, k, nnodes))
            launch = engine_launch_spec(actor.launch_options(node))
            command = engine_command(launch, FIRST_PORT + 2 * j, nccl_port=FIRST_PORT + 2 * j + 1)
            assert command[1:3] == ["-m", "sglang.launch_server"], command
            lines.append(EngineLine(job.metadata.name, topology.placement, j, k, command[3:]))
    return lines


def router_lines(tmp_dir: str) -> list[tuple[str, list[str], list[str]]]:
    """(job, router arguments, worker URLs) for each example job: the router built as the rollout
    manager builds it, in front of the job's engines."""
    lines = []
    for job in example_jobs():
        nnodes = job.spec.rollout.nodes_per_engine
        urls = [f"http://{pod_ip(j, 0, nnodes)}:{FIRST_PORT + 2 * j}" for j in range(_topology(job).num_engines)]
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
        line = engine_lines(job, host_of=lambda j, k, n: "$POD_IP")[0]
        command = shlex.join(["python", "-m", "sglang.launch_server", *line.argv]).replace("'$POD_IP'", "$POD_IP")
        command = command.replace(f"'$POD_IP:{DIST_PORT}'", f"$POD_IP:{DIST_PORT}")  # node 0 is where its nodes meet
        nodes = job.spec.rollout.nodes_per_engine
        of_nodes = f", node 0 of {nodes}" if nodes > 1 else ""
        parts.append(f"# {line.job} ({line.placement}): engine 0 of {_topology(job).num_engines}{of_nodes}\n{_wrap(command)}")
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
        nodes_per_engine=job.spec.rollout.nodes_per_engine,
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
