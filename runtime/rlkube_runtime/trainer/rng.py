"""Capture and restore every random generator a training step can touch.

Python's `random`, NumPy's global generator (when NumPy is installed), torch's CPU generator and
every CUDA device's generator. The captured state is made of tensors, ints, floats, strings,
tuples and None only, so `torch.load(..., weights_only=True)` reads it back.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # NumPy is optional for the runtime
    np = None


def capture_rng_state() -> dict[str, Any]:
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "python": (py_version, torch.tensor(py_state, dtype=torch.int64), py_gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(int(x) for x in py_state.tolist()), py_gauss))
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            # A resume on a different GPU layout: the CUDA streams cannot be matched up, so they
            # keep their fresh seeds; everything else is still restored.
            warnings.warn(
                f"checkpoint has RNG states for {len(cuda_states)} CUDA devices, this process sees "
                f"{torch.cuda.device_count()}; CUDA generators not restored",
                stacklevel=2,
            )
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
