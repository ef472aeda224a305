"""Moving weights in and out of the built-in engine's model.

Two `serialized_named_tensors` formats of /update_weights_from_tensor:
- `rlkube_safetensors` (`encode_named_tensors` / `decode_named_tensors`): base64 of the
  safetensors bytes of a name→tensor dict, the bytes themselves in the request. A piece may be
  a block of rows of a larger tensor (its first row in the header's `rlkube_row_offsets`), so
  one request never has to hold a whole embedding matrix.
- SGLang's default (load_format null or "direct"): base64 of a `ForkingPickler` dump of a list
  of (name, tensor) pairs. The tensors travel as handles, not bytes: CUDA IPC handles on a GPU
  (naming it by UUID, as SGLang's patched torch reductions do), shared memory on a CPU, so sender
  and engine must share the machine (and the GPU). `encode_shared_named_tensors` writes one;
  `decode_shared_named_tensors` unpickles only what such a dump contains.

Any subset of the state dict may be sent; names and shapes are checked against the model before
anything is copied, so a bad update changes nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pathlib
import pickle
from collections.abc import Mapping
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions
from safetensors.torch import load, load_file, save

from rlkube_runtime.engine.protocol import ProtocolError
from rlkube_runtime.expert_names import per_expert_views
from rlkube_runtime.memory import PinnedOffload, unique_named_tensors

ROW_OFFSETS_KEY = "rlkube_row_offsets"


def encode_named_tensors(tensors: Mapping[str, torch.Tensor], row_offsets: Mapping[str, int] | None = None) -> str:
    """One `rlkube_safetensors` entry (tensors go through the CPU). `row_offsets[name]`: the
    tensor is rows [offset, offset + len) of the model's tensor of that name."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    metadata = {ROW_OFFSETS_KEY: json.dumps(dict(row_offsets))} if row_offsets else None
    return base64.b64encode(save(cpu, metadata=metadata)).decode("ascii")


def decode_named_tensors(serialized: str) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(tensors, row offsets of the pieces that are blocks of rows)."""
    try:
        raw = base64.b64decode(serialized, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ProtocolError("serialized_named_tensors[0]", f"is not valid base64: {err}") from None
    try:
        tensors = load(raw)
        header_len = int.from_bytes(raw[:8], "little")
        metadata = json.loads(raw[8 : 8 + header_len]).get("__metadata__") or {}
        offsets = json.loads(metadata.get(ROW_OFFSETS_KEY, "{}"))
    except Exception as err:  # safetensors raises several error types on bad bytes
        raise ProtocolError("serialized_named_tensors[0]", f"is not safetensors data: {err}") from None
    return tensors, {str(k): int(v) for k, v in offsets.items()}


# What a ForkingPickler dump of (name, tensor) pairs refers to; nothing else is unpickled.
_SHARED_TENSOR_GLOBALS = {
    ("torch.multiprocessing.reductions", name)
    for name in ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
                 "rebuild_storage_fd", "rebuild_storage_filename", "rebuild_storage_empty")
} | {("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch.storage", "UntypedStorage"),
     ("torch.storage", "TypedStorage"), ("torch.nn.parameter", "Parameter"), ("multiprocessing.resource_sharer", "DupFd"),
     ("collections", "OrderedDict")}


# Where torch's CUDA tensor reduction puts the device index among rebuild_cuda_tensor's arguments.
_CUDA_DEVICE_ARG = 6


def encode_shared_named_tensors(pairs: list[tuple[str, torch.Tensor]]) -> str:
    """One entry of SGLang's default format: (name, tensor) handles, pickled as SGLang's patched
    torch reductions pickle them. A CUDA tensor names its GPU by UUID, not by index: an engine's
    rank sees its GPUs under other indices than the trainer rank does (Ray gives each process its
    own CUDA_VISIBLE_DEVICES), and SGLang's ranks map the UUID back to theirs."""
    buffer = io.BytesIO()
    _UuidPickler(buffer).dump(pairs)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class _UuidPickler(ForkingPickler):
    """ForkingPickler with a CUDA tensor's device index swapped for its GPU's UUID."""

    def reducer_override(self, obj):  # consulted before the dispatch table, for every object
        if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
            return NotImplemented
        rebuild, args = reductions.reduce_tensor(obj)
        args = list(args)
        args[_CUDA_DEVICE_ARG] = gpu_uuid(args[_CUDA_DEVICE_ARG])
        return rebuild, tuple(args)


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _rebuild_cuda_tensor_by_uuid(*args):
    """torch's rebuild_cuda_tensor, for handles that name their GPU by UUID (or, from older
    senders, by index): the UUID becomes this process's index of that GPU."""
    args = list(args)
    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        local = [i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == device]
        if not local:
            raise ValueError(f"the tensor handle is on GPU {device}, which this process cannot see")
        args[_CUDA_DEVICE_ARG] = local[0]
    return reductions.rebuild_cuda_tensor(*args)


class _SharedTensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_by_uuid
        if (module, name) in _SHARED_TENSOR_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor handle")


def decode_shared_named_tensors(serialized: str, *, field: str = "serialized_named_tensors[0]") -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of SGLang's default format; the tensors are the sender's memory."""
    try:
        raw = base64.b64decode(serialized, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ProtocolError(field, f"is not valid base64: {err}") from None
    try:
        pairs = _SharedTensorUnpickler(io.BytesIO(raw)).load()
    except Exception as err:  # a bad pickle, a refused global, or a handle this process cannot open
        raise ProtocolError(field, f"is not a list of (name, tensor) handles this engine can open: {err}") from None
    if not isinstance(pairs, list) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor) for p in pairs
    ):
        raise ProtocolError(field, "must hold a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in pairs]


def load_checkpoint_tensors(model_path: str) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in a HF checkpoint directory."""
    directory = pathlib.Path(model_path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise ProtocolError("model_path", f"{model_path!r} is not a directory holding *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def update_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a weight update may name: the model's state dict, where a fused MoE experts
    parameter also answers to its experts' checkpoint names (views into it: expert_names.py)."""
    targets = model.state_dict(keep_vars=True)
    targets.update(list(per_expert_views((k, v.detach()) for k, v in targets.items())))
    return targets


def copy_into_model(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, field: str, row_offsets: Mapping[str, int] | None = None
) -> int:
    """Copy `tensors` into the model's parameters and buffers of the same names (a name in
    `row_offsets` fills rows [offset, offset + len) only).

    A float8_e4m3fn weight comes with `<name>_scale_inv` (fp8 rollout) and is dequantized into
    the model's weight first (rlkube_runtime/fp8.py). Everything is validated first (unknown names,
    shape mismatches, missing scales), so an invalid update leaves the model untouched. Returns
    how many weights were copied.
    """
    from rlkube_runtime import fp8

    try:  # fp8 rollout: an e4m3 weight and its block scales become the weight, in float32
        tensors, row_offsets = fp8.dequantize_named(tensors, row_offsets)
    except ValueError as err:
        raise ProtocolError(field, str(err)) from None
    offsets = row_offsets or {}
    targets = update_targets(model)
    unknown = sorted(set(tensors) - set(targets))
    if unknown:
        sample = ", ".join(sorted(targets)[:4])
        raise ProtocolError(field, f"unknown tensor names {unknown[:5]} (the model has e.g. {sample})")
    for name, tensor in tensors.items():
        expected = list(targets[name].shape)
        if name in offsets:
            start = offsets[name]
            if tensor.dim() == 0 or list(tensor.shape[1:]) != expected[1:] or not 0 <= start <= expected[0] - tensor.shape[0]:
                raise ProtocolError(
                    field, f"tensor {name!r}: rows [{start}, {start + (tensor.shape[0] if tensor.dim() else 0)}) of shape "
                    f"{list(tensor.shape)} do not fit the model's {expected}"
                )
        elif list(tensor.shape) != expected:
            raise ProtocolError(field, f"tensor {name!r} has shape {list(tensor.shape)}, the model expects {expected}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            target = targets[name].data
            if name in offsets:
                target = target[offsets[name] : offsets[name] + tensor.shape[0]]
            target.copy_(tensor.to(device=target.device, dtype=target.dtype), non_blocking=True)
    if any(targets[name].device.type == "cuda" for name in tensors):
        # The sender may reuse (or free) its buffers once the engine answers.
        torch.cuda.synchronize()
    return len(tensors)


class WeightOffload:
    """Holds the model's weights off the accelerator while memory is released.

    On CUDA the weights move to pinned host memory (one asynchronous copy each way; the host
    copies are kept for the next release) and the parameters point at empty storage, so the GPU
    memory is really freed; on CPU the parameters are detached the same way and the originals
    kept aside, so the model cannot run until `restore`.
    """

    def __init__(self) -> None:
        self._saved: dict[str, torch.Tensor] | None = None
        self._pinned = PinnedOffload()

    @property
    def offloaded(self) -> bool:
        return self._saved is not None

    def offload(self, model: torch.nn.Module) -> None:
        if self._saved is not None:
            return
        saved = {}
        tensors = unique_named_tensors(model)
        for name, tensor in tensors:
            on_gpu = tensor.device.type == "cuda"
            saved[name] = self._pinned.to_host((name,), tensor.data) if on_gpu else tensor.data
        if any(t.device.type == "cuda" for _, t in tensors):
            self._pinned.wait(tensors[0][1].device)
        for name, tensor in tensors:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self._saved = saved
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def restore(self, model: torch.nn.Module) -> None:
        if self._saved is None:
            return
        tensors = unique_named_tensors(model)
        for name, tensor in tensors:
            saved = self._saved[name]
            tensor.data = self._pinned.to_device(saved, tensor.device) if tensor.device.type == "cuda" else saved
        if any(t.device.type == "cuda" for _, t in tensors):
            self._pinned.wait(tensors[0][1].device)
        self._saved = None
