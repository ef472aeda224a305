"""The block-fp8 checkpoint an fp8 rollout's engines start from (rlkube_runtime/fp8_checkpoint.py):
what is quantized and how it is stored (SGLang's fp8 layout), reading it back, and writing it
once per job even when several engines start together."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlkube_runtime import fp8
from rlkube_runtime.fp8_checkpoint import (
    SOURCE_RECORD,
    Fp8CheckpointError,
    block_size,
    is_fp8_checkpoint,
    read_dequantized,
    write_fp8_checkpoint,
)
from rlkube_runtime.tiny.model import build_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def test_the_decoder_linear_weights_are_stored_e4m3_with_block_scales_and_the_rest_as_they_were(tiny_dir, tmp_path):
    target = write_fp8_checkpoint(tiny_dir, tmp_path / "fp8")
    source, stored = load_file(tiny_dir / "model.safetensors"), load_file(target / "model.safetensors")
    quantized = [n for n, t in source.items() if fp8.is_quantized_name(n, t.shape)]
    layers = json.loads((tiny_dir / "config.json").read_text())["num_hidden_layers"]
    assert len(quantized) == 7 * layers  # q k v o gate up down of every layer
    assert set(stored) == set(source) | {n + "_scale_inv" for n in quantized}
    for name, tensor in source.items():
        if name in quantized:
            q, scale = fp8.quantize_blockwise(tensor)
            assert stored[name].dtype == torch.float8_e4m3fn and stored[name + "_scale_inv"].dtype == torch.float32
            assert torch.equal(stored[name].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(stored[name + "_scale_inv"], scale)
        else:  # embeddings, norms, head: untouched
            assert stored[name].dtype == tensor.dtype and torch.equal(stored[name], tensor)


def test_its_config_says_block_fp8_as_sglang_reads_it_and_the_tokenizer_comes_along(tiny_dir, tmp_path):
    target = write_fp8_checkpoint(tiny_dir, tmp_path / "fp8")
    config, original = (json.loads((d / "config.json").read_text()) for d in (target, tiny_dir))
    assert config.pop("quantization_config") == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                 "weight_block_size": [128, 128]}
    assert config == original
    assert is_fp8_checkpoint(target) and not is_fp8_checkpoint(tiny_dir)
    assert block_size(target) == (128, 128)
    copied = {p.name for p in tiny_dir.iterdir()} - {"model.safetensors", "config.json"}
    assert copied and copied <= {p.name for p in target.iterdir()}


def test_read_back_it_holds_the_quantize_dequantized_weights(tiny_dir, tmp_path):
    target = write_fp8_checkpoint(tiny_dir, tmp_path / "fp8")
    source = load_file(tiny_dir / "model.safetensors")
    back = read_dequantized(target)
    assert set(back) == set(source)
    for name, tensor in source.items():
        expected = fp8.quantize_dequantize(tensor.float()) if fp8.is_quantized_name(name, tensor.shape) else tensor
        assert torch.equal(back[name].to(expected.dtype), expected), name


def test_a_sharded_model_keeps_its_shards_and_its_index_names_the_scales(tmp_path):
    source = tmp_path / "sharded"
    source.mkdir()
    w0, w1 = torch.randn(256, 130), torch.randn(130, 256)
    save_file({"model.layers.0.self_attn.q_proj.weight": w0, "model.norm.weight": torch.ones(130)},
              str(source / "model-00001-of-00002.safetensors"))
    save_file({"model.layers.0.mlp.down_proj.weight": w1}, str(source / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": 1}, "weight_map": {
        "model.layers.0.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.down_proj.weight": "model-00002-of-00002.safetensors"}}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    (source / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    target = write_fp8_checkpoint(source, tmp_path / "fp8")
    written = json.loads((target / "model.safetensors.index.json").read_text())
    assert written["metadata"] == index["metadata"]
    assert written["weight_map"] == {**index["weight_map"],
                                     "model.layers.0.self_attn.q_proj.weight_scale_inv": "model-00001-of-00002.safetensors",
                                     "model.layers.0.mlp.down_proj.weight_scale_inv": "model-00002-of-00002.safetensors"}
    second = load_file(target / "model-00002-of-00002.safetensors")
    assert second["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 2)  # ceil(130/128) x ceil(256/128)
    assert torch.equal(read_dequantized(target)["model.layers.0.mlp.down_proj.weight"], fp8.quantize_dequantize(w1))


def test_it_is_written_once_kept_while_the_source_is_unchanged_and_remade_when_it_changes(tiny_dir, tmp_path):
    target = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_dir, target)
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    write_fp8_checkpoint(tiny_dir, target)
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    other = build_tiny_checkpoint(tmp_path / "other", seed=1)
    write_fp8_checkpoint(other, target)
    assert json.loads((target / SOURCE_RECORD).read_text())["source"] == str(other.resolve())
    assert torch.equal(read_dequantized(target)["model.norm.weight"], load_file(other / "model.safetensors")["model.norm.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "other"]  # no staging or old copies left


def test_engines_writing_it_at_once_all_get_one_whole_copy(tiny_dir, tmp_path):
    target, errors = tmp_path / "fp8", []

    def engine_start():
        try:
            write_fp8_checkpoint(tiny_dir, target)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    starts = [threading.Thread(target=engine_start) for _ in range(4)]
    for start in starts:
        start.start()
    for start in starts:
        start.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]
    assert set(read_dequantized(target)) == set(load_file(tiny_dir / "model.safetensors"))


def test_a_model_without_safetensors_or_already_in_fp8_is_refused_by_name(tiny_dir, tmp_path):
    bare = tmp_path / "bin-only"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    (bare / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(Fp8CheckpointError, match="safetensors weights only"):
        write_fp8_checkpoint(bare, tmp_path / "fp8")
    with pytest.raises(Fp8CheckpointError, match="no config.json"):
        write_fp8_checkpoint(tmp_path / "missing", tmp_path / "fp8")
    already = write_fp8_checkpoint(tiny_dir, tmp_path / "fp8")
    with pytest.raises(Fp8CheckpointError, match="already float8_e4m3fn"):
        write_fp8_checkpoint(already, tmp_path / "fp8-again")
    assert not (tmp_path / "fp8-again").exists()
