"""The engines' starting checkpoint for fp8 rollout (spec.model.rolloutDtype fp8).

SGLang serves block-fp8 weights only from a checkpoint stored that way: a weight update cannot
turn a bf16 model into an fp8 one, because the fp8 layers (and their `weight_scale_inv`
parameters) are made when the model is loaded, from config.json's `quantization_config`. So
before an engine starts, the job's HF directory is copied with every decoder-layer linear weight
quantized (rlkube_runtime/fp8.py) and `quantization_config` added; each sync then sends e4m3
weights with their scales into those parameters. The built-in engine starts from the same
directory (`read_dequantized`), so both engines load one artifact.

Written once per job into a temporary sibling and renamed into place: engines starting together on
one volume never read half of one, and a directory made from other weights is replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from rlkube_runtime import fp8

SOURCE_RECORD = "rlkube_fp8_source.json"  # which files (names, sizes, mtimes) it was made from
_INDEX = "model.safetensors.index.json"


class Fp8CheckpointError(ValueError):
    """The model directory cannot be served in fp8 (no safetensors weights, a malformed index)."""


def is_fp8_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path`'s config.json says its weights are stored block-fp8 (SGLang's reading)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return "fp8" in str(quantization.get("quant_method", ""))


def block_size(path: str | os.PathLike) -> tuple[int, int]:
    """The (rows, columns) of the quantization blocks an fp8 checkpoint's config.json names."""
    quantization = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise Fp8CheckpointError(f"{path}/config.json: quantization_config.weight_block_size must be two positive "
                                 f"integers (block-fp8), got {block!r}")
    return block[0], block[1]


def write_fp8_checkpoint(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """`target`: `source` with its decoder-layer linear weights in block-fp8 and config.json
    saying so. Kept when it exists and was made from the same source files; returns its path."""
    source, target = Path(source), Path(target)
    shards = _weight_files(source)
    record = _source_record(source, shards)
    if _made_from(target, record):
        return target
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        weight_map = {}
        for shard in shards:
            tensors = _quantized_shard(source / shard)
            _save(tensors, staging / shard)
            weight_map.update(dict.fromkeys(tensors, shard))
        if (source / _INDEX).is_file():
            index = json.loads((source / _INDEX).read_text())
            index["weight_map"] = dict(sorted(weight_map.items()))
            (staging / _INDEX).write_text(json.dumps(index, indent=2))
        config = json.loads((source / "config.json").read_text())
        config["quantization_config"] = fp8.quantization_config()
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        for other in source.iterdir():  # tokenizer, generation config, chat template
            if other.is_file() and other.name not in {"config.json", _INDEX, *shards}:
                shutil.copy2(other, staging / other.name)
        (staging / SOURCE_RECORD).write_text(json.dumps(record, indent=2))
        _move_into_place(staging, target, record)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def read_dequantized(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """An fp8 checkpoint's tensors with each e4m3 weight and its scales replaced by their float32
    dequantized value (what an engine serving it computes with); the rest as stored."""
    path = Path(path)
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in _weight_files(path):
        tensors.update(load_file(path / shard))
    try:
        dequantized, _ = fp8.dequantize_named(tensors, block=block_size(path))
    except ValueError as err:
        raise Fp8CheckpointError(f"{path}: {err}") from None
    return dequantized


def check_source(path: str | os.PathLike) -> None:
    """Raises Fp8CheckpointError unless `path` holds what `write_fp8_checkpoint` reads."""
    _weight_files(Path(path))


def _weight_files(path: Path) -> list[str]:
    """The safetensors files holding `path`'s weights: the index's shards, else model.safetensors."""
    if not (path / "config.json").is_file():
        raise Fp8CheckpointError(f"{path}: no config.json (model.rolloutDtype fp8 needs a local HF model directory)")
    if (path / _INDEX).is_file():
        try:
            return sorted(set(json.loads((path / _INDEX).read_text())["weight_map"].values()))
        except (KeyError, AttributeError, json.JSONDecodeError) as err:
            raise Fp8CheckpointError(f"{path / _INDEX}: not a safetensors index ({err})") from None
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise Fp8CheckpointError(f"{path}: no model.safetensors or {_INDEX}; model.rolloutDtype fp8 writes the engines' "
                             f"fp8 checkpoint from safetensors weights only")


def _quantized_shard(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(file).items():
        if tensor.dtype == fp8.FP8_DTYPE:
            raise Fp8CheckpointError(f"{file}: {name!r} is already float8_e4m3fn; give model.hfCheckpoint the "
                                     f"high-precision model (rlkube quantizes it)")
        if tensor.is_floating_point():
            out.update(fp8.quantize_named(name, tensor))
        else:
            out[name] = tensor
    return out


def _save(tensors: dict[str, torch.Tensor], file: Path) -> None:
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors.items()}, str(file), metadata={"format": "pt"})


def _source_record(source: Path, shards: list[str]) -> dict:
    files = {}
    for name in ["config.json", *shards]:
        stat = (source / name).stat()
        files[name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return {"source": str(source.resolve()), "files": files, "quantization_config": fp8.quantization_config()}


def _made_from(target: Path, record: dict) -> bool:
    try:
        return json.loads((target / SOURCE_RECORD).read_text()) == record
    except (OSError, json.JSONDecodeError):
        return False


def _move_into_place(staging: Path, target: Path, record: dict) -> None:
    """Rename `staging` to `target`; one another engine put there first is kept, an older one
    (other weights, or half-removed) is moved aside and removed."""
    for _ in range(3):
        try:
            os.rename(staging, target)
            return
        except OSError:
            if _made_from(target, record):
                return
            aside = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
    raise Fp8CheckpointError(f"{target}: could not be replaced (another process keeps writing it)")
