"""A module's tensors, and moving them between the GPU and pinned host memory (colocated
placement: the trainer and the engines take turns with the GPU).

Each device tensor gets a pinned host twin the first time it is offloaded, kept for the run:
every later offload or onload is one asynchronous copy per tensor at the full host link speed
(pageable copies run at a fraction of it and allocate on every move). Callers swap tensors in
place (`param.data`, optimizer state entries), so modules, DDP and optimizers keep their
references.
"""

from __future__ import annotations

import torch


def unique_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict with tied tensors (an LM head sharing the embedding) listed once."""
    seen: set[tuple[int, int]] = set()
    unique = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = (tensor.data_ptr(), tensor.numel()) if tensor.numel() else (id(tensor), 0)
        if key in seen:
            continue
        seen.add(key)
        unique.append((name, tensor))
    return unique


class PinnedOffload:
    def __init__(self) -> None:
        self._twins: dict[tuple, torch.Tensor] = {}

    def to_host(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """The pinned twin of `tensor` (keyed by `key`), filled asynchronously; call `wait` before
        the device copy is freed or the twin is read."""
        twin = self._twins.get(key)
        if twin is None or twin.shape != tensor.shape or twin.dtype != tensor.dtype:
            twin = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._twins[key] = twin
        twin.copy_(tensor, non_blocking=True)
        return twin

    @staticmethod
    def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        out.copy_(tensor, non_blocking=True)
        return out

    @staticmethod
    def wait(device: torch.device) -> None:
        torch.cuda.synchronize(device)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._twins.values())
