"""When an engine process counts as ready: after /health_generate, then /flush_cache (as slime waits).

A stub HTTP server stands in for the engine: `/health` is up at once, `/health_generate` answers 503
a few times (SGLang does while its scheduler starts), `/flush_cache` refuses once (SGLang does
while a request, the health check's included, is still in its scheduler).
"""

import pathlib
import sys

from rlkube_runtime.serving.launch import EngineLaunchSpec, EngineProcess, ManagedProcess, free_port

STUB = r"""
import http.server, sys
calls = {"/health_generate": 0, "/flush_cache": 0}
ANSWERS = {"/health_generate": [503, 503, 503, 200], "/flush_cache": [400, 200]}

class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self):
        if self.path == "/health":
            status = 200
        else:
            n = calls[self.path] = calls[self.path] + 1
            status = ANSWERS[self.path][min(n, len(ANSWERS[self.path])) - 1]
        print(self.command, self.path, status, flush=True)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
    do_GET = do_POST = answer
    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def _stub_engine(tmp_path: pathlib.Path) -> EngineProcess:
    """An EngineProcess whose process is the stub server instead of an engine command."""
    port = free_port()
    spec = EngineLaunchSpec(kind="builtin", model_path="/unused", log_dir=str(tmp_path), name="stub", startup_timeout_s=30)
    engine = EngineProcess.__new__(EngineProcess)
    engine.spec, engine.port, engine.nccl_port, engine.url = spec, port, None, f"http://127.0.0.1:{port}"
    ManagedProcess.__init__(engine, [sys.executable, "-c", STUB, str(port)], log_path=tmp_path / "stub.log")
    return engine


def test_engine_is_ready_only_after_a_real_generation_and_a_successful_cache_flush(tmp_path):
    engine = _stub_engine(tmp_path)
    try:
        assert engine.wait_ready() is engine
        calls = [line for line in engine.log_tail(100).splitlines() if line.startswith(("GET", "POST"))]
    finally:
        engine.stop()
    # /health alone never made it ready; the generation check passed before any flush, and the
    # flush was retried until it succeeded.
    assert all(" /health " not in line for line in calls)
    assert calls == [
        "GET /health_generate 503", "GET /health_generate 503", "GET /health_generate 503", "GET /health_generate 200",
        "POST /flush_cache 400", "POST /flush_cache 200",
    ]


# Speaks no HTTP: what the health poll meets when another program (here as Ray's gRPC servers do)
# took the engine's port between free_port() and the engine's own bind.
SQUATTER = r"""
import socket, sys
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(bytes.fromhex("000018040000000000000400400000000500400000"))  # an HTTP/2 SETTINGS frame
    conn.close()
"""


def test_an_engine_whose_port_another_program_took_starts_again_on_a_free_one(tmp_path, tiny_model_dir, monkeypatch):
    import subprocess

    from rlkube_runtime.serving import launch

    taken = free_port()
    squatter = subprocess.Popen([sys.executable, "-c", SQUATTER, str(taken)], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "listening"
        ports = iter([taken])
        monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": next(ports, None) or free_port(host))
        engine = launch.start_engine(model_path=str(tiny_model_dir), log_dir=str(tmp_path), name="e", startup_timeout_s=120)
        try:
            assert engine.port != taken
            status, _ = launch.http_request("GET", engine.url + "/health")
            assert status == 200
        finally:
            engine.stop()
    finally:
        squatter.kill()
        squatter.wait()
    # The first engine said why it stopped; its log is the one the retry reused.
    assert "address already in use" in (tmp_path / "e.log").read_text().lower()


# SGLang's node_rank >= 1 process: once its schedulers are up it serves only this (engine.py,
# `launch_dummy_health_check_server`), no /flush_cache and no generation.
SGLANG_NODE = r"""
import sys, time
from sglang.srt.utils.common import launch_dummy_health_check_server
launch_dummy_health_check_server("127.0.0.1", int(sys.argv[1]), False)
while True:
    time.sleep(1)
"""


def test_a_node_other_than_0_of_a_multi_node_engine_is_ready_when_sglangs_health_only_server_answers(tmp_path):
    from sglang_testutil import require_pinned_sglang

    from rlkube_runtime.serving.sglang_args import EngineNode

    require_pinned_sglang()
    port = free_port()
    spec = EngineLaunchSpec(kind="sglang", model_path="/unused", log_dir=str(tmp_path), name="node-1",
                            startup_timeout_s=60, tp_size=16, node=EngineNode(2, 1, "127.0.0.1:29600"))
    engine = EngineProcess.__new__(EngineProcess)
    engine.spec, engine.port, engine.nccl_port, engine.url = spec, port, None, f"http://127.0.0.1:{port}"
    ManagedProcess.__init__(engine, [sys.executable, "-c", SGLANG_NODE, str(port)], log_path=tmp_path / "node.log")
    try:
        assert engine.wait_ready() is engine  # node 0's readiness (/flush_cache) would never come
        assert engine.alive()
    finally:
        engine.stop()
