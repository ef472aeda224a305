"""`rlkube convert` round trip: HF -> megatron distributed checkpoint (sharded for tensor x
pipeline ranks, one CPU process each) -> HF, bitwise."""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import tiny_hf

from rlkube_runtime.cli import main


def _tensors(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "tensor", "pipeline"), [("qwen3", 2, 1), ("llama", 1, 2)])
def test_convert_round_trip_is_bitwise(kind, tensor, pipeline, tmp_path):
    hf = tiny_hf(kind, tmp_path / "hf")
    assert main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "mg"),
                 "--tensor", str(tensor), "--pipeline", str(pipeline)]) == 0
    assert (tmp_path / "mg" / "metadata.json").is_file()
    assert main(["convert", "megatron-to-hf", "--checkpoint", str(tmp_path / "mg"), "--hf-config", str(hf),
                 "--out", str(tmp_path / "back")]) == 0
    want, got = _tensors(hf), _tensors(tmp_path / "back")
    assert set(got) == set(want)
    for name, tensor_ in want.items():
        assert torch.equal(got[name], tensor_), name
    assert (tmp_path / "back" / "tokenizer.json").is_file()


def test_convert_errors_name_the_argument(tmp_path, capsys):
    hf = tiny_hf("llama", tmp_path / "hf")
    assert main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "mg"), "--tensor", "8"]) == 2
    assert "--tensor: 8 does not divide" in capsys.readouterr().err
    assert main(["convert", "megatron-to-hf", "--checkpoint", str(tmp_path), "--hf-config", str(hf),
                 "--out", str(tmp_path / "x")]) == 2
    assert "no megatron distributed checkpoint" in capsys.readouterr().err
