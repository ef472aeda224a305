"""Running megatron-core on the CPU (tests, CI, tiny CPU runs), on hosts with or without a GPU.

megatron-core allocates a few tensors with `device=torch.cuda.current_device()` (rotary
frequencies, all-gather outputs, attention buffers), keeps its dropout streams as CUDA generator
states, and dist_checkpointing synchronises CUDA after its copies. Inside `cpu_mode()` these
point at the CPU: current_device answers "cpu", synchronize does nothing (CPU copies are done
when they return), and megatron's RNG-state helpers read and set the CPU generator. The swap is
undone when the block ends, so GPU code elsewhere in the process is untouched; the CPU backend
runs each of its calls inside it. `seed_cpu_rng_tracker` gives megatron's RNG tracker CPU
generator states.

What stays GPU-only: megatron-core's DistributedDataParallel, distributed optimizer and pipeline
schedule allocate on CUDA, so the CPU backend trains with torch AdamW and without pipelining.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

_LOCK = threading.RLock()
_DEPTH = 0
_SAVED: dict[str, object] = {}


@contextlib.contextmanager
def cpu_mode():
    """megatron-core's CUDA-only spots redirected to the CPU for the duration (re-entrant)."""
    global _DEPTH
    from megatron.core.tensor_parallel import random as mrandom

    with _LOCK:
        if _DEPTH == 0:
            _SAVED.update(current_device=torch.cuda.current_device, synchronize=torch.cuda.synchronize,
                          get_state=mrandom._get_cuda_rng_state, set_state=mrandom._set_cuda_rng_state)
            torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
            torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
            mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
            mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                torch.cuda.current_device = _SAVED["current_device"]  # type: ignore[assignment]
                torch.cuda.synchronize = _SAVED["synchronize"]  # type: ignore[assignment]
                mrandom._get_cuda_rng_state = _SAVED["get_state"]
                mrandom._set_cuda_rng_state = _SAVED["set_state"]


def in_cpu_mode(method):
    """Decorator for backend methods: run inside `cpu_mode()` when the backend is on the CPU."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not self.cpu:
            return method(self, *args, **kwargs)
        with cpu_mode():
            return method(self, *args, **kwargs)

    return wrapper


def seed_cpu_rng_tracker(seed: int) -> None:
    """megatron's RNG tracker with CPU generator states seeded as model_parallel_cuda_manual_seed
    seeds its CUDA ones (the tensor-parallel stream offset by the TP rank)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _CpuRngTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _tracker_base():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


class _CpuRngTracker(_tracker_base()):
    """megatron-core's tracker with CPU generator states in place of CUDA ones."""

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise ValueError(f"RNG state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()
