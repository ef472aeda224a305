"""Atomic checkpoints: what a crash leaves behind is skipped, the newest complete one is loaded."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from rlkube_runtime.trainer.checkpoint import (
    MARKER,
    CheckpointSaveError,
    CheckpointSkippedWarning,
    clean_partial_checkpoints,
    list_checkpoints,
    load_latest_checkpoint,
    publish_directory,
    read_latest,
    remove_temporaries,
    save_checkpoint,
    temporary_sibling,
)


def payload(step: int) -> dict:
    return {
        "model": {"w": torch.full((3, 2), float(step)), "b": torch.arange(step + 1)},
        "rng": {"python": (3, torch.arange(4), None)},
        "data_source": {"epoch": 1, "offset": step * 10, "buffer": [[1, 2], []]},
    }


def test_round_trip_keeps_tensors_and_json_state(tmp_path):
    path = save_checkpoint(tmp_path, 7, payload(7))
    assert path.name == "rollout_00000007"
    assert (path / "data_source.json").is_file() and (path / "model.pt").is_file()
    manifest = json.loads((path / MARKER).read_text())
    assert set(manifest["files"]) == {"model.pt", "rng.pt", "data_source.json"}
    assert read_latest(tmp_path) == 7

    loaded = load_latest_checkpoint(tmp_path)
    assert loaded.rollout_id == 7 and loaded.path == path
    assert torch.equal(loaded.payload["model"]["w"], torch.full((3, 2), 7.0))
    assert loaded.payload["rng"]["python"][0] == 3 and isinstance(loaded.payload["rng"]["python"], tuple)
    assert loaded.payload["data_source"] == {"epoch": 1, "offset": 70, "buffer": [[1, 2], []]}


def test_no_checkpoint_gives_none(tmp_path):
    assert load_latest_checkpoint(tmp_path / "missing") is None
    assert load_latest_checkpoint(tmp_path) is None


def test_partial_and_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path):
    for i in (1, 2, 3):
        save_checkpoint(tmp_path, i, payload(i))
    # A save that crashed before its rename.
    tmp = tmp_path / ".tmp-rollout_00000009-deadbeef"
    tmp.mkdir()
    (tmp / "model.pt").write_bytes(b"half a file")
    # One renamed but without its marker.
    save_checkpoint(tmp_path, 8, payload(8))
    (tmp_path / "rollout_00000008" / MARKER).unlink()
    # Complete ones whose files changed afterwards: same size, other bytes; and truncated.
    flipped = save_checkpoint(tmp_path, 7, payload(7)) / "model.pt"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated = save_checkpoint(tmp_path, 6, payload(6)) / "data_source.json"
    truncated.write_text("{}")
    missing = save_checkpoint(tmp_path, 5, payload(5)) / "rng.pt"
    missing.unlink()

    with pytest.warns(CheckpointSkippedWarning) as record:
        loaded = load_latest_checkpoint(tmp_path)
    assert loaded.rollout_id == 3
    assert torch.equal(loaded.payload["model"]["w"], torch.full((3, 2), 3.0))
    messages = [str(w.message) for w in record]
    assert len(messages) == 4
    assert "rollout_00000008" in messages[0] and "no 'complete' marker" in messages[0]
    assert "rollout_00000007" in messages[1] and "model.pt sha256" in messages[1]
    assert "rollout_00000006" in messages[2] and "data_source.json has 2 bytes" in messages[2]
    assert "rollout_00000005" in messages[3] and "rng.pt is missing" in messages[3]
    assert not any(".tmp-" in m for m in messages)


def test_clean_partial_removes_tmp_and_unmarked_directories_only(tmp_path):
    save_checkpoint(tmp_path, 1, payload(1))
    (tmp_path / ".tmp-rollout_00000002-0000").mkdir()
    save_checkpoint(tmp_path, 3, payload(3))
    (tmp_path / "rollout_00000003" / MARKER).unlink()
    removed = clean_partial_checkpoints(tmp_path)
    assert sorted(p.name for p in removed) == [".tmp-rollout_00000002-0000", "rollout_00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "rollout_00000001"]


def test_keep_prunes_older_complete_checkpoints(tmp_path):
    for i in range(1, 6):
        save_checkpoint(tmp_path, i, payload(i), keep=2)
    assert [i for i, _ in list_checkpoints(tmp_path)] == [4, 5]
    save_checkpoint(tmp_path, 6, payload(6), keep=1)
    assert [i for i, _ in list_checkpoints(tmp_path)] == [6]
    assert load_latest_checkpoint(tmp_path).rollout_id == 6


def test_saving_a_rollout_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 4, payload(4))
    save_checkpoint(tmp_path, 4, {"model": {"w": torch.zeros(1)}})
    loaded = load_latest_checkpoint(tmp_path)
    assert set(loaded.payload) == {"model"} and torch.equal(loaded.payload["model"]["w"], torch.zeros(1))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_ids_sort_numerically(tmp_path):
    save_checkpoint(tmp_path, 10, payload(10))
    save_checkpoint(tmp_path, 9, payload(9))
    assert load_latest_checkpoint(tmp_path).rollout_id == 10


def test_bad_arguments_name_the_value(tmp_path):
    with pytest.raises(ValueError, match="payload key '../x' is not usable as a file name"):
        save_checkpoint(tmp_path, 1, {"../x": 1})
    with pytest.raises(ValueError, match="keep must be >= 1"):
        save_checkpoint(tmp_path, 1, {"x": 1}, keep=0)


def test_a_full_disk_fails_the_save_naming_the_cause_and_keeps_the_older_checkpoints(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 2, {"model": {"w": torch.ones(3)}})
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        # What torch.save does on ENOSPC: the OSError only as the context of its own RuntimeError.
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(tmp_path, 5, {"model": {"w": torch.ones(3)}})
    message = str(info.value)
    assert f"could not save the checkpoint of rollout 5 in {tmp_path}: No space left on device" in message
    assert f"newest: rollout 2, {tmp_path / 'rollout_00000002'}" in message
    assert "unexpected pos" not in message
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "rollout_00000002"]  # the partial save removed
    assert load_latest_checkpoint(tmp_path).rollout_id == 2


def test_a_published_directory_replaces_the_old_one_whole_and_leftover_temporaries_are_removed(tmp_path):
    """The HF exports' write: into a `.tmp-` sibling, then one rename over any older export."""
    final = tmp_path / "exports" / "rollout_2"
    final.mkdir(parents=True)
    (final / "old.safetensors").write_text("old")
    tmp = temporary_sibling(final)
    assert tmp.parent == final.parent and tmp.name.startswith(".tmp-rollout_2-")
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("new")
    assert publish_directory(tmp, final) == final
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors"] and not tmp.exists()
    cut_short = temporary_sibling(tmp_path / "exports" / "rollout_4")
    cut_short.mkdir()
    (cut_short / "part").write_text("x")
    assert remove_temporaries(tmp_path / "exports") == [cut_short]
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["rollout_2"]
    assert remove_temporaries(tmp_path / "missing") == []

