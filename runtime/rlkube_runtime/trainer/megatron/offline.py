"""`rlkube convert`: HF directories <-> megatron distributed checkpoints, outside a training run.

hf-to-megatron writes the model as a megatron-core distributed checkpoint (torch_dist) sharded
for the given tensor x pipeline sizes: one CPU process per shard (gloo), each building its
stage's GPTModel and saving its part, so the files are exactly what such a trainer writes.
megatron-to-hf reads the model from such a checkpoint (or a trainer checkpoint, which holds one
under `trainer/`) in one process at tensor = pipeline = 1, torch_dist resharding the saved
parts, and writes an HF directory: the config and tokenizer of --hf-config, safetensors weights.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

INFO_FILE = "rlkube_megatron.json"


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, tensor: int = 1, pipeline: int = 1) -> Path:
    """Shard the HF checkpoint in `hf_dir` into a distributed checkpoint at `out_dir`."""
    import torch.multiprocessing as mp
    from transformers import AutoConfig

    from .model import ParallelSizes, check_divisible, hf_architecture

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    try:
        check_divisible(hf_architecture(AutoConfig.from_pretrained(hf_dir)), ParallelSizes(tensor=tensor, pipeline=pipeline),
                        training=False)
    except ValueError as err:  # the sizes come from the command line here, not from a spec
        raise ValueError(str(err).replace("spec.parallelism.tensor", "--tensor").replace(
            "spec.parallelism.pipeline", "--pipeline")) from err
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"--out {out_dir} is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    world = tensor * pipeline
    with tempfile.TemporaryDirectory() as rendezvous:
        store = os.path.join(rendezvous, "store")
        if world == 1:
            _save_shard(0, 1, store, hf_dir, out_dir, tensor, pipeline)
        else:
            mp.start_processes(_save_shard, args=(world, store, hf_dir, out_dir, tensor, pipeline),
                               nprocs=world, start_method="spawn")
    (out_dir / INFO_FILE).write_text(json.dumps(
        {"format": "megatron_dist", "source": str(hf_dir), "tensor": tensor, "pipeline": pipeline}, indent=1))
    return out_dir


def megatron_to_hf(checkpoint: str | Path, hf_config_dir: str | Path, out_dir: str | Path) -> Path:
    """The HF directory of the model in `checkpoint` (a distributed checkpoint directory, a
    trainer checkpoint `rollout_*` directory, or a checkpoint root: its newest complete one)."""
    from .cpu import cpu_mode

    with cpu_mode():
        return _megatron_to_hf(checkpoint, hf_config_dir, out_dir)


def _megatron_to_hf(checkpoint: str | Path, hf_config_dir: str | Path, out_dir: str | Path) -> Path:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    from . import convert
    from .checkpoint import load_model_state
    from .parallel import init_parallel_state, seed_model_parallel
    from .weights import named_weights, write_hf_directory
    from .model import ParallelSizes, build_gpt_model, hf_architecture, transformer_config

    source = find_distributed_checkpoint(Path(checkpoint))
    arch = hf_architecture(AutoConfig.from_pretrained(hf_config_dir))
    created = not dist.is_initialized()
    sizes = ParallelSizes()
    init_parallel_state(sizes, cpu=True)
    try:
        seed_model_parallel(0, cpu=True)
        config = transformer_config(arch, sizes, dtype=torch.float32, cpu=True, training=False)
        model = build_gpt_model(config, arch, pre_process=True, post_process=True)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="")}, str(source))
        load_model_state(model, loaded["model"], source)
        full = {name: t.detach().float() for name, t in named_weights(model)
                if not (name == "output_layer.weight" and arch.tie_word_embeddings)}
        weights = convert.megatron_to_hf(full, arch)
        return write_hf_directory(weights, out_dir, str(hf_config_dir), trust_remote_code=False,
                                  tied=arch.tie_word_embeddings)
    finally:
        if created:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def find_distributed_checkpoint(path: Path) -> Path:
    """The directory holding metadata.json for `path` (see `megatron_to_hf`)."""
    from ..checkpoint import list_checkpoints

    if (path / "metadata.json").is_file():
        return path
    if (path / "trainer" / "metadata.json").is_file():
        return path / "trainer"
    complete = [p for _, p in list_checkpoints(path)] if path.is_dir() else []
    for candidate in reversed(complete):
        if (candidate / "trainer" / "metadata.json").is_file():
            return candidate / "trainer"
    raise FileNotFoundError(
        f"--checkpoint {path}: no megatron distributed checkpoint there (no metadata.json in it, in trainer/, "
        "or in a complete rollout_* checkpoint under it)"
    )


def _save_shard(rank: int, world: int, store_path: str, hf_dir: Path, out_dir: Path, tensor: int, pipeline: int) -> None:
    """One tensor/pipeline rank: build its stage, load its share of the HF weights, save it."""
    from .cpu import cpu_mode

    with cpu_mode():
        _save_shard_on_cpu(rank, world, store_path, hf_dir, out_dir, tensor, pipeline)


def _save_shard_on_cpu(rank: int, world: int, store_path: str, hf_dir: Path, out_dir: Path, tensor: int,
                       pipeline: int) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from .parallel import init_parallel_state, seed_model_parallel
    from .weights import load_hf_into
    from .model import ParallelSizes, build_gpt_model, hf_architecture, transformer_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        sizes = ParallelSizes(tensor=tensor, pipeline=pipeline)
        arch = hf_architecture(AutoConfig.from_pretrained(hf_dir))
        init_parallel_state(sizes, cpu=True)
        seed_model_parallel(0, cpu=True)
        config = transformer_config(arch, sizes, dtype=torch.float32, cpu=True, training=False)
        model = build_gpt_model(config, arch, pre_process=ps.is_pipeline_first_stage(),
                                post_process=ps.is_pipeline_last_stage())
        load_hf_into(model, hf_dir, arch, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tensor)
        dist_checkpointing.save({"model": model.sharded_state_dict(prefix="")}, str(out_dir))
        dist.barrier()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
