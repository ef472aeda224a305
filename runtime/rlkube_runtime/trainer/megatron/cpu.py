"""Running megatron-core on a host without CUDA (tests, CI, tiny CPU runs).

megatron-core allocates a few tensors with `device=torch.cuda.current_device()` (rotary
frequencies, all-gather outputs, attention buffers) and keeps its dropout streams as CUDA
generator states, and dist_checkpointing synchronises CUDA after its copies. On a CPU-only host
`enable_cpu_mode` points these at the CPU: current_device answers "cpu", synchronize does
nothing (CPU copies are done when they return), and the RNG tracker keeps CPU generator states. It is only ever applied when
CUDA is unavailable, where nothing else in the process could use CUDA anyway; on a GPU host
megatron-core runs untouched.

What stays GPU-only: megatron-core's DistributedDataParallel and distributed optimizer allocate
their gradient buffers on CUDA, so the CPU backend trains with torch AdamW (see backend.py).
"""

from __future__ import annotations

import torch

_ENABLED = False


def enable_cpu_mode(seed: int) -> None:
    """Redirect megatron-core's CUDA-only spots to the CPU and seed its RNG tracker from `seed`
    (the tensor-parallel stream offset by the TP rank, as model_parallel_cuda_manual_seed does)."""
    global _ENABLED
    if torch.cuda.is_available():
        raise RuntimeError("enable_cpu_mode is for hosts without CUDA; this one has a GPU")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if not _ENABLED:
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *args, **kwargs: None  # dist_checkpointing's save waits on copies
        mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
        _ENABLED = True
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
