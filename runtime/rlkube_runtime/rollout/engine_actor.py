"""A Ray actor that owns one rollout engine process on the node (and GPUs) of its bundle.

The actor exists for placement: Ray puts it in the engine's bundle, so the server it starts (a
SGLang server or the built-in engine) runs on that pod with that bundle's GPUs. Restarting an
engine is killing the process and starting a new one here, on a fresh port.
"""

from __future__ import annotations

import os
from typing import Any


class EngineActor:
    def __init__(
        self,
        *,
        engine: str,
        model_path: str,
        log_dir: str,
        name: str,
        seed: int,
        device: str,
        gpus_per_engine: int = 1,
        dtype: str = "float32",
        sglang_args: dict[str, Any] | None = None,
    ):
        self.engine = engine
        self.model_path = model_path
        self.log_dir = log_dir
        self.name = name
        self.seed = seed
        self.device = device
        self.gpus_per_engine = gpus_per_engine
        self.dtype = dtype
        self.sglang_args = sglang_args or {}
        self._process = None
        self._restarts = 0

    def start(self) -> str:
        from rlkube_runtime.rollout.launch import start_engine

        engine_args: dict[str, Any] = {"dtype": self.dtype}
        if self.engine == "builtin" and self.device == "cpu":
            # The engine shares the machine with the trainer: one thread each keeps them from
            # fighting over the cores.
            engine_args["num-threads"] = 1
        self._process = start_engine(
            kind=self.engine,
            model_path=self.model_path,
            log_dir=self.log_dir,
            name=f"{self.name}-{self._restarts}",
            seed=self.seed,
            device=self.device,
            tp_size=self.gpus_per_engine,
            sglang_args=self.sglang_args,
            engine_args=engine_args,
            gpu_ids=_ray_gpu_ids(),
        )
        return self._process.url

    def restart(self) -> str:
        self.stop()
        self._restarts += 1
        return self.start()

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid


def _ray_gpu_ids() -> list[int]:
    try:
        import ray

        return [int(i) for i in ray.get_gpu_ids()]
    except Exception:  # outside Ray (tests) there are no assigned GPUs
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return [int(i) for i in visible.split(",") if i.strip().isdigit()]
