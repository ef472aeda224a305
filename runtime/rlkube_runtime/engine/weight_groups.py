"""Process groups a trainer opens to the engine for /update_weights_from_distributed (SGLang's API).

Each group is a small world of its own: a TCPStore at the trainer's address and a
ProcessGroupNCCL (or ProcessGroupGloo, on a CPU) built on it, outside any default process group.
So a trainer can open one group per engine, and an engine that replaces a crashed one just gets
a new group. The trainer is rank 0 and broadcasts every tensor of an update in the order of the
request's `names`; the engine, rank `rank_offset`, receives them (into its parameters directly
when dtype and shape match) and copies them into the model.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from rlkube_runtime.engine.protocol import DistributedUpdate, GroupSpec, ProtocolError
from rlkube_runtime.engine.weights import update_targets

log = logging.getLogger(__name__)

GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def open_group(spec: GroupSpec, device: torch.device, host: str) -> dist.ProcessGroup:
    """Join the group rank 0 created (blocks until its store answers); `host` is the address this
    engine serves on, named in errors. gloo and NCCL listen where GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME say, which the launcher sets to the interface holding `host`."""
    if spec.backend == "nccl" and device.type != "cuda":
        raise ProtocolError("backend", f"'nccl' needs a GPU; this engine runs on {device.type}: use 'gloo'")
    try:
        store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size, False, timeout=GROUP_TIMEOUT)
    except RuntimeError as err:
        raise RuntimeError(
            f"the engine at {host} could not reach the trainer's weight update group {spec.group_name!r} at "
            f"{spec.master_address}:{spec.master_port} within {GROUP_TIMEOUT.total_seconds():.0f} s: {err}; the "
            "rollout pods must reach the trainer pods at their node addresses (NetworkPolicy, firewall)"
        ) from err
    if spec.backend == "nccl":
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, spec.rank_offset, spec.world_size, GROUP_TIMEOUT)
    return dist.ProcessGroupGloo(store, spec.rank_offset, spec.world_size, GROUP_TIMEOUT)


def receive_into_model(model: torch.nn.Module, group: dist.ProcessGroup, update: DistributedUpdate) -> int:
    """Receive every tensor of `update` from rank 0 and copy it into the model.

    A float8_e4m3fn weight with its `<name>_scale_inv` among the names (fp8 rollout) is received
    as its bytes and dequantized into the model's weight (rlkube_runtime/fp8.py). The broadcasts are
    received even when the request does not fit the model (the sender is already sending; leaving
    them unanswered would hang it), then the error is raised and the model is left as it was.
    """
    from rlkube_runtime import fp8

    targets = update_targets(model)
    problem = _mismatch(targets, update)
    device = next(model.parameters()).device
    received: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
    works = []
    options = dist.BroadcastOptions()
    options.rootRank = 0
    with torch.no_grad():
        for name, dtype, shape in zip(update.names, update.dtypes, update.shapes):
            target = None if problem or name not in targets else targets[name].data
            direct = target is not None and target.dtype == dtype and target.is_contiguous()
            buffer = target if direct else torch.empty(shape, dtype=dtype, device=device)
            # float8 as its bytes: gloo has no float8 type (the sender broadcasts bytes too).
            works.append(group.broadcast([buffer.view(torch.uint8) if dtype == fp8.FP8_DTYPE else buffer], options))
            received.append((name, buffer, None if direct else target))
        for work in works:
            work.wait()
        if problem:
            raise ProtocolError("names", problem)
        quantized = {name: buffer for name, buffer, _ in received if buffer.dtype == fp8.FP8_DTYPE}
        pieces = {name: buffer for name, buffer, _ in received if name in quantized or
                  name.removesuffix(fp8.SCALE_SUFFIX) in quantized}
        try:
            dequantized, _ = fp8.dequantize_named(pieces)
        except ValueError as err:
            raise ProtocolError("names", str(err)) from None
        for name, buffer, target in received:
            if name in dequantized:
                target.copy_(dequantized[name])
            elif target is not None and name not in pieces:
                target.copy_(buffer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(update.names)


def _mismatch(targets: dict[str, torch.Tensor], update: DistributedUpdate) -> str | None:
    from rlkube_runtime import fp8

    quantized = {n for n, d in zip(update.names, update.dtypes) if d == fp8.FP8_DTYPE}
    scales = {fp8.scale_name(n) for n in quantized} & set(update.names)
    unknown = [n for n in update.names if n not in targets and n not in scales]
    if unknown:
        return f"unknown tensor names {unknown[:5]} (the model has e.g. {', '.join(sorted(targets)[:4])})"
    for name, shape in zip(update.names, update.shapes):
        if name in scales:
            continue
        if tuple(targets[name].shape) != tuple(shape):
            return f"tensor {name!r} has shape {list(shape)}, the model expects {list(targets[name].shape)}"
    for name in quantized:
        if fp8.scale_name(name) not in scales:
            return f"{name!r} is float8_e4m3fn but {fp8.scale_name(name)!r} (its block scales) is not in names"
        shape = tuple(update.shapes[update.names.index(name)])
        scale = tuple(update.shapes[update.names.index(fp8.scale_name(name))])
        if len(shape) != 2 or scale != fp8.scale_shape(shape):
            return f"{fp8.scale_name(name)!r} has shape {list(scale)}, a {list(shape)} weight has {list(fp8.scale_shape(shape)) if len(shape) == 2 else '2-D'} block scales"
    return None
