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

    def move(self, key: tuple, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`tensor` on `device`: into its pinned twin when that is the host, else a device copy."""
        if device.type == "cpu":
            return self.to_host(key, tensor)
        return self.to_device(tensor, device)

    def move_module(self, module: torch.nn.Module, tag: str, device: torch.device) -> None:
        """Every parameter and buffer of `module` to `device`, in place (`.data` swapped)."""
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.device != device:
                tensor.data = self.move((tag, name), tensor.data, device)

    def move_optimizer(self, optimizer: torch.optim.Optimizer, tag: str, device: torch.device, *,
                       params: bool = False) -> None:
        """The optimizer's state tensors (Adam's moments) to `device`, in place; with `params`
        also its parameters (a master copy the optimizer owns, such as megatron's fp32 shards).
        Scalar entries (Adam's `step`) stay where torch keeps them."""
        if params:
            for g, group in enumerate(optimizer.param_groups):
                for i, p in enumerate(group["params"]):
                    if p.device != device:
                        p.data = self.move((tag, "param", g, i), p.data, device)
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                    state[key] = self.move((tag, id(param), key), value, device)

    @staticmethod
    def wait(device: torch.device) -> None:
        torch.cuda.synchronize(device)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._twins.values())
