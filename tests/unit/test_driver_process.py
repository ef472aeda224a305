"""What the local run's light processes load: the driver (plan, loop, actor classes, metrics) and
the rollout manager never import torch, which costs 2 to 3 CPU-seconds per process start and
which they do not use (the trainer and engine processes do); the tiny checkpoint comes from its
cache and the tiny tokenizer loads as its named class."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlkube_runtime.data.tokenizer import load_tokenizer, named_tokenizer_class
from rlkube_runtime.tiny import cache as tiny_cache

REPO = Path(__file__).resolve().parents[2]


def _loaded_after(code: str) -> dict[str, bool]:
    probe = code + "\nimport json, sys\nprint(json.dumps({m: m in sys.modules for m in ('torch', 'transformers')}))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": f"{REPO / 'runtime'}:{REPO / 'operator'}", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_driver_modules_load_without_torch():
    loaded = _loaded_after(
        "import rlkube_runtime.cli, rlkube_runtime.run.main, rlkube_runtime.run.loop, rlkube_runtime.run.plan\n"
        "import rlkube_runtime.actors.trainer_group, rlkube_runtime.actors.rollout_group, rlkube_runtime.metrics\n"
        "from rlkube_runtime.trainer.support import check_trainer_supports\n"
        "import rlkube_runtime.trainer.checkpoint"
    )
    assert loaded == {"torch": False, "transformers": False}


def test_the_rollout_manager_loads_the_tiny_tokenizer_without_torch(tmp_path):
    model = tiny_cache.tiny_checkpoint(tmp_path / "model", root=tmp_path / "cache", seed=0)
    assert named_tokenizer_class(str(model)) == "PreTrainedTokenizerFast"
    loaded = _loaded_after(
        "import rlkube_runtime.actors.rollout_manager\n"
        "from rlkube_runtime.data.tokenizer import load_tokenizer\n"
        f"tokenizer = load_tokenizer({str(model)!r})\n"
        "assert tokenizer.decode(tokenizer('12+3')['input_ids']) == '12+3'"
    )
    assert loaded == {"torch": False, "transformers": True}


def test_the_direct_tokenizer_is_the_one_autotokenizer_loads(tmp_path):
    from transformers import AutoTokenizer

    model = str(tiny_cache.tiny_checkpoint(tmp_path / "model", root=tmp_path / "cache", seed=0))
    direct, auto = load_tokenizer(model), AutoTokenizer.from_pretrained(model)
    text = "What is 12 + 30?\n\tAnswer: 42"
    assert type(direct) is type(auto)
    assert direct(text)["input_ids"] == auto(text)["input_ids"]
    assert direct.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True) \
        == auto.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    assert (direct.pad_token_id, direct.eos_token_id, direct.padding_side) == (auto.pad_token_id, auto.eos_token_id,
                                                                                auto.padding_side)


def test_a_checkpoint_naming_another_tokenizer_class_goes_through_autotokenizer(tmp_path, monkeypatch):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2TokenizerFast"}))
    import transformers

    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, path, **kw: calls.append((path, kw)) or "auto"))
    assert load_tokenizer(str(tmp_path), trust_remote_code=True) == "auto"
    assert calls == [(str(tmp_path), {"trust_remote_code": True})]
    assert named_tokenizer_class(str(tmp_path / "absent")) is None


def test_a_cached_tiny_checkpoint_is_the_built_one_and_is_not_built_again(tmp_path, monkeypatch):
    from rlkube_runtime.tiny.model import build_tiny_checkpoint

    fresh = build_tiny_checkpoint(tmp_path / "fresh", alphabet="0123456789+=", seed=3)
    first = tiny_cache.tiny_checkpoint(tmp_path / "a", root=tmp_path / "cache", alphabet="0123456789+=", seed=3)
    files = sorted(p.name for p in fresh.iterdir())
    assert sorted(p.name for p in first.iterdir()) == files
    assert all((fresh / f).read_bytes() == (first / f).read_bytes() for f in files)

    import rlkube_runtime.tiny.model as tiny_model

    monkeypatch.setattr(tiny_model, "build_tiny_checkpoint", lambda *a, **k: pytest.fail("built again"))
    second = tiny_cache.tiny_checkpoint(tmp_path / "b", root=tmp_path / "cache", alphabet="0123456789+=", seed=3)
    assert all((fresh / f).read_bytes() == (second / f).read_bytes() for f in files)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # no temporary left beside the entry


def test_other_arguments_are_another_entry():
    assert tiny_cache.checkpoint_key(seed=0) != tiny_cache.checkpoint_key(seed=1)
    assert tiny_cache.checkpoint_key(seed=0, alphabet="ab") != tiny_cache.checkpoint_key(seed=0, alphabet="abc")
    assert tiny_cache.checkpoint_key(seed=0) == tiny_cache.checkpoint_key(seed=0)


def test_an_unwritable_cache_builds_in_place(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    model = tiny_cache.tiny_checkpoint(tmp_path / "model", root=blocked / "cache", seed=0)
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
