"""Every launch line rlkube builds for the example jobs, fed to SGLang's and sglang-router's own parsers.

No GPU, no model: the pinned releases' argument parsers (SGLang's `ServerArgs.add_cli_args` +
`from_cli_args`, the router's `RouterArgs.add_cli_args` + `from_cli_args`) must accept each line,
and the values must land in the fields meant. What is checked, and what cannot be without a GPU
and the model (SGLang's `ServerArgs.__post_init__`), is written in sglang_parse.py.
"""

import json
import pathlib
import subprocess
import sys

import pytest
from example_launch_lines import (
    DIST_PORT,
    FIRST_PORT,
    README,
    engine_lines,
    example_jobs,
    pod_ip,
    readme_block,
    router_lines,
    sglang_jobs,
)
from sglang_testutil import require_pinned_sglang

from rlkube_runtime.serving.sglang_args import COLOCATED_MEM_FRACTION_STATIC, SGLangServerConfig, sglang_server_args

PARSER = pathlib.Path(__file__).with_name("sglang_parse.py")

# Lines SGLang must refuse, so the check above is known not to accept anything.
MUST_FAIL = {
    "unknown flag": ["--model-path", "/m", "--no-such-flag", "1"],
    "ill-typed value": ["--model-path", "/m", "--tp-size", "two"],
    "value outside choices": ["--model-path", "/m", "--dtype", "fp8"],
    "value given to a bare flag": ["--model-path", "/m", "--skip-server-warmup", "true"],
    "abbreviated flag": ["--model-path", "/m", "--mem-frac", "0.5"],
    "one field set twice": ["--model-path", "/m", "--tp-size", "2", "--tensor-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def sglang_parsed(tmp_path_factory):
    """SGLang's verdict on every example engine line (each node's, for an engine over several) and the MUST_FAIL lines."""
    require_pinned_sglang()
    lines = {f"{line.job}/engine-{line.index}/node-{line.node}": line for job in sglang_jobs() for line in engine_lines(job)}
    keyed = sglang_server_args(SGLangServerConfig(model_path="/m", host="10.0.0.1", port=30000, tp_size=1, seed=0,
                                                  dtype="bfloat16", api_key="job-key", return_routed_experts=True,
                                                  lora_rank=16, lora_target_modules=("q_proj", "down_proj", "lm_head")))
    argvs = [line.argv for line in lines.values()] + list(MUST_FAIL.values()) + [keyed]
    work = tmp_path_factory.mktemp("sglang-parse")
    (work / "in.json").write_text(json.dumps(argvs))
    run = subprocess.run([sys.executable, str(PARSER), str(work / "in.json"), str(work / "out.json")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"importing sglang's server_args failed:\n{run.stderr[-3000:]}"
    results = json.loads((work / "out.json").read_text())
    n = len(lines)
    return {
        "engines": dict(zip(lines, zip(lines.values(), results[:n]))),
        "must_fail": dict(zip(MUST_FAIL, results[n:n + len(MUST_FAIL)])),
        "keyed": results[-1],
    }


@pytest.mark.slow  # imports sglang's server_args (torch, transformers) in a subprocess: ~5-10 s
def test_every_example_engine_line_is_accepted_by_sglangs_own_parser_with_the_values_meant(sglang_parsed):
    engines = sglang_parsed["engines"]
    assert {name.split("/")[0] for name in engines} == {job.metadata.name for job in sglang_jobs()}
    jobs = {job.metadata.name: job.spec for job in example_jobs()}
    for name, (line, result) in engines.items():
        assert result["error"] is None, f"{name}: SGLang refuses `{' '.join(line.argv)}`: {result['error']}"
        spec, values = jobs[line.job], result["values"]
        colocated = line.placement == "colocated"
        user_fraction = spec.rollout.sglang_args.get("mem-fraction-static")
        assert values["model_path"] == spec.model.hf_checkpoint, name
        nodes = spec.rollout.nodes_per_engine
        assert (values["host"], values["port"], values["nccl_port"]) == (
            pod_ip(line.index, line.node, nodes), FIRST_PORT + 2 * line.index, FIRST_PORT + 2 * line.index + 1), name
        assert values["tp_size"] == spec.rollout.gpus_per_engine, name
        assert values["random_seed"] == spec.training.seed + line.index, name
        assert values["dtype"] == str(getattr(spec.model.dtype, "value", spec.model.dtype)), name
        assert values["skip_server_warmup"] is True and values["trust_remote_code"] is False, name
        assert values["enable_memory_saver"] is colocated, name
        expected_fraction = user_fraction if user_fraction is not None else (COLOCATED_MEM_FRACTION_STATIC if colocated else None)
        assert values["mem_fraction_static"] == expected_fraction, name
        assert (values["nnodes"], values["node_rank"], values["base_gpu_id"]) == (nodes, line.node, 0), name
        # The nodes of an engine meet at node 0's pod (None: one node, SGLang picks its own port).
        meeting = f"{pod_ip(line.index, 0, nodes)}:{DIST_PORT}" if nodes > 1 else None
        assert values["dist_init_addr"] == meeting, name


@pytest.mark.slow
def test_an_engine_over_two_pods_has_one_line_per_node_each_taken_by_sglang_as_its_node(sglang_parsed):
    [job] = [job for job in sglang_jobs() if job.spec.rollout.nodes_per_engine > 1]
    parsed = [(name, result) for name, (line, result) in sglang_parsed["engines"].items() if line.job == job.metadata.name]
    assert [name.split("/", 1)[1] for name, _ in parsed] == [
        "engine-0/node-0", "engine-0/node-1", "engine-1/node-0", "engine-1/node-1"]
    assert [(r["values"]["nnodes"], r["values"]["node_rank"], r["values"]["dist_init_addr"], r["values"]["tp_size"])
            for _, r in parsed] == [(2, 0, "10.0.0.1:29600", 16), (2, 1, "10.0.0.1:29600", 16),
                                    (2, 0, "10.0.0.3:29600", 16), (2, 1, "10.0.0.3:29600", 16)]


@pytest.mark.slow
def test_a_line_with_the_jobs_api_key_routing_replay_and_lora_gives_sglang_each(sglang_parsed):
    keyed = sglang_parsed["keyed"]
    assert keyed["error"] is None and keyed["values"]["api_key"] == "job-key", keyed
    assert keyed["values"]["enable_return_routed_experts"] is True, keyed
    values = keyed["values"]  # spec.training.lora: adapters of its rank on its layers may be loaded
    assert (values["enable_lora"], values["max_lora_rank"]) == (True, 16), keyed
    assert set(values["lora_target_modules"]) == {"q_proj", "down_proj", "lm_head"}, keyed


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MUST_FAIL))
def test_sglangs_parser_as_used_here_refuses_bad_lines(sglang_parsed, case):
    assert sglang_parsed["must_fail"][case]["error"], f"{case}: {MUST_FAIL[case]} was accepted"


def _parse_router(argv: list[str]):
    """The router's own `parse_router_args`, but raising instead of exiting, and with no abbreviations."""
    import argparse

    from sglang_router.router_args import RouterArgs

    class StrictParser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    parser = StrictParser(allow_abbrev=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)


def test_every_example_router_line_is_accepted_by_sglang_routers_own_parser(tmp_path):
    lines = router_lines(str(tmp_path))
    assert len(lines) == len(example_jobs())
    for job, argv, urls in lines:
        args = _parse_router(argv)
        assert (args.host, args.port, args.prometheus_port, args.prometheus_host) == ("127.0.0.1", 8000, 29000, "127.0.0.1"), job
        assert args.worker_urls == urls and args.model_path == str(tmp_path), job
    assert _parse_router(["--port", "8000", "--api-key", "job-key"]).api_key == "job-key"
    with pytest.raises(ValueError, match="unrecognized"):
        _parse_router(["--port", "8000", "--no-such-flag"])
    with pytest.raises(ValueError, match="invalid int"):
        _parse_router(["--port", "eighty"])


def test_rlkubes_router_launcher_reads_every_example_line_as_sglang_routers_own_launcher_does(tmp_path, capsys):
    """serving/router_main.py skips the upstream launcher's import of SGLang, not its parsing."""
    from sglang_router.launch_router import parse_router_args as upstream

    from rlkube_runtime.serving.router_main import parse_router_args

    for job, argv, _ in router_lines(str(tmp_path)):
        assert parse_router_args(argv) == upstream(argv), job
    with pytest.raises(SystemExit):
        parse_router_args(["--port", "8000", "--mini-lb"])
    assert "remove mini-lb from spec.rollout.routerArgs" in capsys.readouterr().err


def test_readme_shows_the_launch_lines_the_function_builds():
    block = readme_block()
    assert block in README.read_text(), (
        "README.md's production block is stale; regenerate it with `python tests/unit/engine/example_launch_lines.py` "
        f"and paste it in:\n{block}"
    )
