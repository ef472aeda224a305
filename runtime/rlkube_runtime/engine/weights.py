"""Moving weights in and out of the built-in engine's model.

`encode_named_tensors` / `decode_named_tensors` define the `rlkube_safetensors` load format of
/update_weights_from_tensor: base64 of the safetensors bytes of a name→tensor dict. Any subset of
the state dict may be sent; names and shapes are checked against the model before anything is
copied, so a bad update changes nothing.
"""

from __future__ import annotations

import base64
import binascii
import pathlib

import torch
from safetensors.torch import load, load_file, save

from rlkube_runtime.engine.protocol import ProtocolError


def encode_named_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """One `serialized_named_tensors` entry for the built-in engine (tensors go through the CPU)."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return base64.b64encode(save(cpu)).decode("ascii")


def decode_named_tensors(serialized: str) -> dict[str, torch.Tensor]:
    try:
        raw = base64.b64decode(serialized, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ProtocolError("serialized_named_tensors[0]", f"is not valid base64: {err}") from None
    try:
        return load(raw)
    except Exception as err:  # safetensors raises several error types on bad bytes
        raise ProtocolError("serialized_named_tensors[0]", f"is not safetensors data: {err}") from None


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


def copy_into_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor], *, field: str) -> int:
    """Copy `tensors` into the model's parameters and buffers of the same names.

    Everything is validated first (unknown names, shape mismatches), so an invalid update leaves
    the model untouched. Returns how many tensors were copied.
    """
    targets = model.state_dict(keep_vars=True)
    unknown = sorted(set(tensors) - set(targets))
    if unknown:
        sample = ", ".join(sorted(targets)[:4])
        raise ProtocolError(field, f"unknown tensor names {unknown[:5]} (the model has e.g. {sample})")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ProtocolError(
                field, f"tensor {name!r} has shape {list(tensor.shape)}, the model expects {list(targets[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].data.copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
    return len(tensors)


class WeightOffload:
    """Holds the model's weights off the accelerator while memory is released.

    On CUDA the weights move to host memory and the model's parameters point at empty storage, so
    the GPU memory is really freed; on CPU the parameters are detached the same way and the
    originals kept aside, so the model cannot run until `restore`.
    """

    def __init__(self) -> None:
        self._saved: dict[str, torch.Tensor] | None = None

    @property
    def offloaded(self) -> bool:
        return self._saved is not None

    def offload(self, model: torch.nn.Module) -> None:
        if self._saved is not None:
            return
        saved = {}
        for name, tensor in _unique_tensors(model).items():
            saved[name] = tensor.data.to("cpu", copy=tensor.device.type != "cpu")
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self._saved = saved
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def restore(self, model: torch.nn.Module) -> None:
        if self._saved is None:
            return
        for name, tensor in _unique_tensors(model).items():
            tensor.data = self._saved[name].to(tensor.device)
        self._saved = None


def _unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State-dict entries with tied weights (embeddings shared with the LM head) listed once."""
    seen: set[int] = set()
    unique = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique[name] = tensor
    return unique
