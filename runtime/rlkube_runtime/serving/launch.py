"""Start rollout engines as child processes, and keep them in hand (the sglang-router: router.py).

Engines are either the built-in engine (`python -m rlkube_runtime.engine`) or SGLang
(`python -m sglang.launch_server`, its flags from `sglang_args.sglang_server_args`); both speak the
same HTTP protocol, so everything after start-up is the same. An engine counts as ready, as in
slime, once `/health_generate` answers (a real one-token generation) and `/flush_cache` succeeds.
Each process gets its own log file, its own session (so its whole process tree can be signalled)
and a parent-death signal (rlkube_runtime/proc.py), and is stopped at interpreter exit: no process outlives the one that
started it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import http.client
import json
import os
import pathlib
import socket
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from rlkube_runtime import proc
from rlkube_runtime.node_network import socket_ifname_env
from rlkube_runtime.serving.auth import auth_headers, job_api_key, redacted
from rlkube_runtime.serving.sglang_args import (
    ArgValue,
    EngineNode,
    SGLangServerConfig,
    cli_flags,
    flag_name,
    lora_flags,
    sglang_server_args,
)

ENGINE_KINDS = ("builtin", "sglang")
# Options of `python -m rlkube_runtime.engine` a caller may pass through `engine_args`.
BUILTIN_ENGINE_OPTIONS = (
    "dtype", "max-running-requests", "context-length", "num-threads", "weight-version", "log-level", "runner",
    "disable-cuda-graph", "enable-torch-compile", "mem-fraction-static", "max-total-tokens", "trust-remote-code",
    "quantization",
)


class ProcessStartError(RuntimeError):
    """A child process died or never became ready; the message quotes the end of its log."""


@dataclasses.dataclass(frozen=True)
class EngineLaunchSpec:
    """Everything needed to start (and restart) one engine."""

    kind: str
    model_path: str
    log_dir: str
    name: str
    seed: int = 0
    device: str = "cpu"
    tp_size: int = 1
    # Loopback is the default for a launcher used on one machine only (tests, a private local
    # Ray); inside a Ray cluster the engine actor passes its node's IP, which other pods reach.
    host: str = "127.0.0.1"
    dtype: str | None = None  # None: the engine's own default
    colocated: bool = False  # shares its GPUs with trainer ranks (SGLang: memory saver, smaller static share)
    trust_remote_code: bool = False  # spec.model.trustRemoteCode
    node: EngineNode = EngineNode()  # which node of a multi-node SGLang engine this process is
    base_gpu_id: int | None = None  # SGLang only; None: the first GPU the process sees
    # Extra flags: rlkube's own for either kind, plus spec.rollout.sglangArgs for kind 'sglang'.
    engine_args: Mapping[str, ArgValue] = dataclasses.field(default_factory=dict)
    gpu_ids: tuple[int, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    startup_timeout_s: float = 600.0
    api_key: str | None = None  # the job's API key, required of every caller (engine_launch_spec: RLKUBE_API_KEY)
    # Every token's routed experts in generate responses (spec.training.routingReplay).
    return_routed_experts: bool = False
    # spec.training.lora: the engine takes adapters of this rank on these layers (None: no LoRA).
    lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()


class ManagedProcess:
    """A child process in its own session, logging to a file, stopped with its whole tree."""

    def __init__(self, command: list[str], *, log_path: pathlib.Path, env: Mapping[str, str] | None = None):
        self.command = command
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(redacted(command))}\n".encode())
            log.flush()
            # Its own process group (stop() reaches grandchildren too), killed with this thread.
            self.popen = proc.start(command, stdout=log, env={**os.environ, **(env or {})})
        _LIVE.add(self)
        self._finalizer = weakref.finalize(self, proc.kill_group, self.popen)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after `timeout_s`."""
        proc.stop_group(self.popen, timeout_s)
        _LIVE.discard(self)
        self._finalizer.detach()

    def kill(self) -> None:
        """SIGKILL at once (what a crash looks like to the router and clients)."""
        proc.kill_group(self.popen)
        _LIVE.discard(self)
        self._finalizer.detach()

    def wait_until_ready(
        self, url: str, path: str, timeout_s: float, what: str, *, method: str = "GET", request_timeout_s: float = 2.0,
        api_key: str | None = None,
    ) -> None:
        """Poll `url + path` until it answers 200; fail fast, quoting the log, if the process dies."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            if not self.alive():
                raise ProcessStartError(
                    f"{what} exited with code {self.popen.returncode} before {url}{path} answered; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            # http.client.HTTPException: not HTTP at all, e.g. another program's gRPC server that
            # took the free port first; the server's own start then fails, and a retry follows.
            with contextlib.suppress(OSError, urllib.error.URLError, http.client.HTTPException):
                status, body = http_request(method, url + path, timeout_s=request_timeout_s, api_key=api_key)
                if status == 200:
                    return
                last = f"HTTP {status}: {body[:200].decode(errors='replace')}"
            if time.monotonic() > deadline:
                self.stop()
                raise ProcessStartError(
                    f"{what} did not answer {method} {url}{path} with 200 within {timeout_s:.0f} s (last: {last}); "
                    f"stopped it. Last lines of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.1)


class EngineProcess(ManagedProcess):
    """One running engine; `url` is what the router and clients talk to."""

    def __init__(self, spec: EngineLaunchSpec, port: int, nccl_port: int | None = None):
        self.spec = spec
        self.port = port
        # SGLang's NCCL rendezvous port, picked with the HTTP port as slime does, and never the
        # HTTP port itself (the kernel may hand a just-released port out twice).
        if nccl_port is None and spec.kind == "sglang":
            nccl_port = _other_free_port(spec.host, port)
        self.nccl_port = nccl_port
        self.url = f"http://{spec.host}:{port}"
        log_path = pathlib.Path(spec.log_dir) / f"{spec.name}.log"
        super().__init__(engine_command(spec, port, self.nccl_port), log_path=log_path, env=engine_env(spec, os.environ))

    def wait_ready(self) -> EngineProcess:
        """Ready as slime counts it: `/health_generate` answers 200, a real one-token generation
        (`/health` answers as soon as the HTTP server is up), then `/flush_cache` succeeds, which
        SGLang refuses while any request, that health check included, is still in the scheduler;
        the engine then starts with an empty cache and an idle scheduler."""
        what = f"engine {self.spec.name!r} ({self.spec.kind})"
        if self.spec.node.node_rank > 0:
            # SGLang's other nodes run no tokenizer and serve no generation: once their schedulers
            # are up (they wait for every node of the engine) each serves a health-only server
            # on its port (launch_dummy_health_check_server), and node 0 answers for the engine.
            self.wait_until_ready(self.url, "/health", self.spec.startup_timeout_s, what, request_timeout_s=30.0)
            return self
        deadline = time.monotonic() + self.spec.startup_timeout_s
        # A generation can take seconds on a loaded GPU: a short per-request timeout would only
        # make the poll give up on answers that were coming.
        self.wait_until_ready(self.url, "/health_generate", self.spec.startup_timeout_s, what, request_timeout_s=30.0,
                              api_key=self.spec.api_key)
        remaining = max(deadline - time.monotonic(), 10.0)
        self.wait_until_ready(self.url, "/flush_cache", remaining, what, method="POST", request_timeout_s=30.0,
                              api_key=self.spec.api_key)
        return self

    def restart(self, *, name: str | None = None) -> EngineProcess:
        """Stop this engine and start the same one again on a fresh port (it must be re-registered)."""
        self.stop()
        return launch_ready(dataclasses.replace(self.spec, name=name or self.spec.name))


# A port picked free can be taken by another program before the server binds it (the server then
# exits saying so): start again on another port, this many times in all.
PORT_ATTEMPTS = 3


def port_was_taken(err: ProcessStartError) -> bool:
    return "address already in use" in str(err).lower()


def launch_ready(spec: EngineLaunchSpec, started: EngineProcess | None = None) -> EngineProcess:
    """`started` (or a new engine of `spec` on a free port) once ready; started again on another
    free port when its port turned out taken."""
    engine = started or EngineProcess(spec, free_port(spec.host))
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return engine.wait_ready()
        except ProcessStartError as err:
            if attempt == PORT_ATTEMPTS or not port_was_taken(err):
                raise
        engine = EngineProcess(spec, free_port(spec.host))
    raise AssertionError("unreachable")


def engine_env(spec: EngineLaunchSpec, environ: Mapping[str, str], interfaces: Mapping[str, Sequence[str]] | None = None) -> dict[str, str]:
    """What an engine process gets on top of the launcher's `environ`: GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME naming the interface that holds the address it serves on (so the weight
    update groups it joins, and SGLang's own NCCL, listen there) unless `environ` has them,
    `spec.env`, and its GPUs. `interfaces` (name -> addresses): this machine's when None."""
    env = {**socket_ifname_env(spec.host, environ, interfaces), **spec.env}
    if spec.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_ids)
    return env


def engine_command(spec: EngineLaunchSpec, port: int, nccl_port: int | None = None) -> list[str]:
    """The command line that starts `spec` on `port` (SGLang also gets `nccl_port` when given)."""
    if spec.kind == "builtin":
        return builtin_engine_command(spec, port)
    if spec.kind == "sglang":
        return [sys.executable, "-m", "sglang.launch_server", *sglang_server_args(sglang_config(spec, port, nccl_port))]
    raise ValueError(f"engine kind must be one of {list(ENGINE_KINDS)}, got {spec.kind!r}")


def builtin_engine_command(spec: EngineLaunchSpec, port: int) -> list[str]:
    """`python -m rlkube_runtime.engine ...`; refuses what the built-in engine cannot do, by name."""
    unknown = sorted(set(map(flag_name, spec.engine_args)) - set(BUILTIN_ENGINE_OPTIONS))
    if unknown:
        raise ValueError(
            f"engine_args {unknown} are not options of the built-in engine; it takes {list(BUILTIN_ENGINE_OPTIONS)} "
            "(SGLang-only arguments apply with kind='sglang')"
        )
    if spec.tp_size != 1:
        raise ValueError(f"tp_size={spec.tp_size}: the built-in engine runs on one device; use kind='sglang' for tensor parallelism")
    if spec.node.nnodes != 1:
        raise ValueError(f"nnodes={spec.node.nnodes}: the built-in engine runs on one device; use kind='sglang' for an engine over several nodes")
    device = "cuda" if spec.device.startswith("cuda") and spec.gpu_ids else spec.device
    base = [sys.executable, "-m", "rlkube_runtime.engine", "--model-path", spec.model_path, "--host", spec.host,
            "--port", str(port), "--seed", str(spec.seed), "--device", device]
    extra = dict(spec.engine_args)
    if spec.trust_remote_code:
        extra["trust-remote-code"] = True
    if spec.api_key:
        extra["api-key"] = spec.api_key
    if spec.return_routed_experts:
        extra["enable-return-routed-experts"] = True
    extra.update(lora_flags(spec.lora_rank, spec.lora_target_modules))
    if spec.dtype is not None:
        extra = {"dtype": spec.dtype, **{k: v for k, v in extra.items() if flag_name(k) != "dtype"}}
    return base + cli_flags(extra)


def sglang_config(spec: EngineLaunchSpec, port: int, nccl_port: int | None = None) -> SGLangServerConfig:
    """What `sglang_server_args` needs from a launch spec; `engine_args` (with sglangArgs) come last."""
    return SGLangServerConfig(
        model_path=spec.model_path,
        host=spec.host,
        port=port,
        nccl_port=nccl_port,
        tp_size=spec.tp_size,
        seed=spec.seed,
        dtype=spec.dtype or "auto",
        colocated=spec.colocated,
        trust_remote_code=spec.trust_remote_code,
        node=spec.node,
        base_gpu_id=spec.base_gpu_id,
        return_routed_experts=spec.return_routed_experts,
        lora_rank=spec.lora_rank,
        lora_target_modules=spec.lora_target_modules,
        user_args=dict(spec.engine_args),
        api_key=spec.api_key,
    )


def start_engine(
    *,
    kind: str = "builtin",
    model_path: str,
    log_dir: str,
    name: str,
    seed: int = 0,
    device: str = "cpu",
    tp_size: int = 1,
    host: str = "127.0.0.1",  # local only; engine actors pass their node's IP
    port: int | None = None,
    dtype: str | None = None,
    colocated: bool = False,
    trust_remote_code: bool = False,
    sglang_args: Mapping[str, ArgValue] | None = None,
    engine_args: Mapping[str, ArgValue] | None = None,
    gpu_ids: Sequence[int] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 600.0,
    api_key: str | None = None,  # None: the job's (RLKUBE_API_KEY), if any
    return_routed_experts: bool = False,
    lora_rank: int | None = None,
    lora_target_modules: Sequence[str] = (),
    node: EngineNode = EngineNode(),  # which node of a multi-node SGLang engine this process is
) -> EngineProcess:
    """Start one engine and return once it is ready (`EngineProcess.wait_ready`).

    `sglang_args` (for kind 'sglang') and `engine_args` (either kind) become `--key value` flags;
    `True` is a bare flag, `False`/`None` are left out. Raises `ProcessStartError` quoting the
    engine's log if it exits or is not healthy within `startup_timeout_s`.
    """
    spec = engine_launch_spec(locals())
    if port is not None:  # the caller's port: no other to try
        return EngineProcess(spec, port).wait_ready()
    return launch_ready(spec)


def start_engines(count: int, *, log_dir: str, name_prefix: str = "engine", seed: int = 0, **kwargs: Any) -> list[EngineProcess]:
    """Start `count` engines at once (seeds seed, seed+1, ...) and wait for all; on any failure
    the ones already started are stopped before the error is raised."""
    started: list[EngineProcess] = []
    if kwargs.get("kind", "builtin") == "builtin" and not str(kwargs.get("device", "cpu")).startswith("cuda"):
        # Built-in CPU engines split the cores instead of each spinning up a thread per core.
        engine_args = dict(kwargs.get("engine_args") or {})
        engine_args.setdefault("num-threads", max(1, (os.cpu_count() or 1) // count))
        kwargs["engine_args"] = engine_args
    try:
        for i in range(count):
            spec = engine_launch_spec({**kwargs, "log_dir": log_dir, "name": f"{name_prefix}-{i}", "seed": seed + i})
            started.append(EngineProcess(spec, free_port(spec.host)))
        for i, engine in enumerate(started):
            started[i] = launch_ready(engine.spec, engine)
        return started
    except BaseException:
        for engine in started:
            engine.stop()
        raise


# ---- helpers -------------------------------------------------------------------------------


def node_ip() -> str:
    """This node's IP as other nodes (pods) reach it: Ray's node address inside Ray. Outside Ray
    (the launcher used on one machine, tests) nothing else needs to reach us: loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:  # the address the port is for (loopback: local only)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _other_free_port(host: str, taken: int) -> int:
    """A free port that is not `taken` (the kernel may hand a just-released port out again)."""
    while True:
        port = free_port(host)
        if port != taken:
            return port


def http_request(method: str, url: str, body: Any = None, timeout_s: float = 10.0,
                 api_key: str | None = None) -> tuple[int, bytes]:
    """A small blocking JSON request (the launcher runs outside any event loop)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **auth_headers(api_key)}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def stop_all() -> None:
    """Stop every process this module started that is still running (also runs at exit)."""
    for process in list(_LIVE):
        process.stop(timeout_s=5.0)


def engine_launch_spec(options: Mapping[str, Any]) -> EngineLaunchSpec:
    """The launch spec `start_engine(**options)` starts (sglang_args merged into engine_args)."""
    kind = options.get("kind", "builtin")
    engine_args = dict(options.get("engine_args") or {})
    sglang_args = dict(options.get("sglang_args") or {})
    if sglang_args and kind != "sglang":
        raise ValueError(f"sglang_args {sorted(sglang_args)} apply only to kind='sglang', got kind={kind!r}")
    names = {f.name for f in dataclasses.fields(EngineLaunchSpec)}
    values = {k: v for k, v in options.items() if k in names and v is not None}
    values["kind"] = kind
    values["engine_args"] = {**engine_args, **sglang_args}
    values["gpu_ids"] = tuple(options.get("gpu_ids") or ())
    values["env"] = dict(options.get("env") or {})
    values["lora_target_modules"] = tuple(options.get("lora_target_modules") or ())
    values.setdefault("api_key", job_api_key())
    return EngineLaunchSpec(**values)


_LIVE: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()
atexit.register(stop_all)
