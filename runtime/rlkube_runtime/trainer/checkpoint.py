"""Atomic, self-verifying checkpoints: a crash at any moment leaves the last complete one usable.

Layout under `root`:

    root/rollout_00000012/         one checkpoint per saved rollout (zero-padded: names sort)
        model.pt optimizer.pt ...  one file per payload entry (torch.save)
        trainer/...                files other writers put there first (begin_checkpoint): the
                                   megatron backend's per-rank distributed checkpoint
        data_source.json ...       entries made only of JSON types are stored as JSON
        complete                   manifest (file sizes + sha256), written last
    root/latest                    the newest saved rollout id, for people and the operator
    root/.tmp-rollout_...          a save in progress (or a crashed one)

A save writes everything into a `.tmp-` directory, fsyncs it, renames it to its final name,
writes the `complete` marker, then replaces `latest`. A checkpoint counts only once its marker
exists and every file matches the manifest, so `load_latest_checkpoint` skips (with a warning)
directories from a crash or with a damaged file, and falls back to the next newest.

One process finishes checkpoints (others may write into the `.tmp-` directory first); saves of different rollouts may overlap (async saves),
which is why a save never deletes `.tmp-` directories: `clean_partial_checkpoints` does, at
startup, when no save can be in flight.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PREFIX = "rollout_"
TMP_PREFIX = ".tmp-"
MARKER = "complete"
LATEST = "latest"
FORMAT_VERSION = 1
_DIR_RE = re.compile(rf"^{PREFIX}(\d+)$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class CheckpointSkippedWarning(UserWarning):
    """A checkpoint directory was passed over while looking for the newest usable one."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint directory is incomplete or does not match its manifest."""


class CheckpointSaveError(OSError):
    """A save failed (a full disk, a lost volume); the message names the directory, the cause and
    the newest checkpoint still intact. The partial save is removed."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the payload passed to `save_checkpoint`, key for key."""

    rollout_id: int
    path: Path
    payload: dict[str, Any]


def checkpoint_dir_name(rollout_id: int) -> str:
    if rollout_id < 0:
        raise ValueError(f"rollout_id must be >= 0, got {rollout_id}")
    return f"{PREFIX}{rollout_id:08d}"


def save_checkpoint(
    root: str | os.PathLike,
    rollout_id: int,
    payload: Mapping[str, Any],
    *,
    keep: int | None = None,
) -> Path:
    """Write `payload` as checkpoint `rollout_id` under `root` atomically; returns its directory.

    payload: name -> value. A value made only of dicts with str keys, lists, str, int, float,
    bool and None goes to `<name>.json`; anything else (state dicts with tensors) to
    `<name>.pt` via torch.save, and must be loadable with `weights_only=True` (tensors, plain
    containers, numbers, strings). keep: how many complete checkpoints to leave (the newest
    always stays); None keeps all. Saving a rollout id again replaces that checkpoint.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"checkpoint keep must be >= 1 (or None to keep all), got {keep}")
    if not payload:
        raise ValueError("checkpoint payload is empty; nothing to save")
    for key in payload:
        if not isinstance(key, str) or not _KEY_RE.match(key) or key == MARKER:
            raise ValueError(
                f"checkpoint payload key {key!r} is not usable as a file name "
                f"(letters, digits, '_', '.', '-'; not starting with '.'; not {MARKER!r})"
            )
    tmp = begin_checkpoint(root, rollout_id)
    return finish_checkpoint(root, rollout_id, tmp, payload, keep=keep)


def begin_checkpoint(root: str | os.PathLike, rollout_id: int) -> Path:
    """The `.tmp-` directory a checkpoint of `rollout_id` is written into before
    `finish_checkpoint` makes it visible; other writers (every rank of a megatron trainer) may
    add files and folders to it first."""
    root = Path(root)
    name = checkpoint_dir_name(rollout_id)
    tmp = root / f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as err:
        raise CheckpointSaveError(_save_failure(root, rollout_id, err)) from err
    return tmp


def finish_checkpoint(
    root: str | os.PathLike,
    rollout_id: int,
    tmp: Path,
    payload: Mapping[str, Any],
    *,
    keep: int | None = None,
) -> Path:
    """Write `payload` into `tmp` (as save_checkpoint does), list every file under `tmp` in the
    manifest, rename it to its final name, then write the marker and `latest`. A failed write
    (a full disk) removes the partial directory and raises CheckpointSaveError naming the cause."""
    root = Path(root)
    name = checkpoint_dir_name(rollout_id)
    try:
        final = _write_checkpoint(root, name, tmp, rollout_id, payload)
    except (OSError, RuntimeError) as err:
        raise abandon_checkpoint(root, rollout_id, tmp, err) from err
    log.info("saved checkpoint %s", final)

    if keep is not None:
        prune_checkpoints(root, keep)
    return final


def abandon_checkpoint(root: str | os.PathLike, rollout_id: int, tmp: Path, err: BaseException) -> CheckpointSaveError:
    """Remove what a failed save of `rollout_id` left (its `tmp` directory, a final directory
    without its marker) and return the error to raise, naming the cause. torch.save reports a
    failed write as a RuntimeError ("unexpected pos ..."), the OSError that caused it (ENOSPC)
    only as its context: the message names the real cause."""
    root = Path(root)
    name = checkpoint_dir_name(rollout_id)
    shutil.rmtree(tmp, ignore_errors=True)  # gives the space back, too
    if (root / name).is_dir() and not (root / name / MARKER).is_file():
        shutil.rmtree(root / name, ignore_errors=True)
    return CheckpointSaveError(_save_failure(root, rollout_id, err))


def save_torch_file(path: str | os.PathLike, value: Any) -> int:
    """torch.save `value` to `path` and fsync it; returns the bytes written. For the checkpoint's
    own files and for the trainer state rank 0 writes straight into a checkpoint being saved."""
    import torch  # here, not at the top: the driver uses this module and otherwise never needs torch

    try:
        with open(path, "wb") as f:
            torch.save(value, f)
            f.flush()
            os.fsync(f.fileno())
            return f.tell()
    except RuntimeError as err:
        # torch.save reports a failed write ("unexpected pos ...") with the disk's OSError only as
        # its context, which does not survive crossing processes: raise that OSError itself.
        cause = _first_os_error(err)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from err


def _first_os_error(err: BaseException) -> OSError | None:
    chain: BaseException | None = err
    while chain is not None:
        if isinstance(chain, OSError):
            return chain
        chain = chain.__cause__ or chain.__context__
    return None


def _write_checkpoint(root: Path, name: str, tmp: Path, rollout_id: int, payload: Mapping[str, Any]) -> Path:
    """The save itself: files into `tmp`, fsync, rename to `name`, marker, `latest`."""
    files: dict[str, str] = {}
    for key, value in payload.items():
        if _is_plain_json(value):
            filename = f"{key}.json"
            _write_bytes(tmp / filename, json.dumps(value, indent=1, sort_keys=True).encode())
        else:
            filename = f"{key}.pt"
            save_torch_file(tmp / filename, value)
        files[key] = filename
    manifest = {
        "format": FORMAT_VERSION,
        "rollout_id": rollout_id,
        "payload": files,
        "files": {fn: {"bytes": (tmp / fn).stat().st_size, "sha256": _sha256(tmp / fn)} for fn in _all_files(tmp)},
    }
    final = publish_directory(tmp, root / name)
    _write_atomic(final / MARKER, json.dumps(manifest, indent=1, sort_keys=True).encode())
    _write_atomic(root / LATEST, f"{rollout_id}\n".encode())
    return final


def publish_directory(tmp: Path, final: Path) -> Path:
    """Give the fully written directory `tmp` the name `final` (same parent) in one rename, after
    fsyncing it, so that `final` is never half written; one already there (a redone rollout's)
    is moved aside and deleted first, since a rename cannot replace a non-empty directory."""
    for sub in sorted({p.parent for p in tmp.rglob("*") if p.is_file()} - {tmp}):
        _fsync_dir(sub)
    _fsync_dir(tmp)
    if final.exists():
        aside = final.parent / f"{TMP_PREFIX}replaced-{final.name}-{secrets.token_hex(4)}"
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def temporary_sibling(final: Path) -> Path:
    """A fresh `.tmp-` name beside `final` to write into before `publish_directory`."""
    return final.parent / f"{TMP_PREFIX}{final.name}-{secrets.token_hex(4)}"


def remove_temporaries(root: str | os.PathLike) -> list[Path]:
    """Delete the `.tmp-` entries under `root` that writes cut short by a crash left."""
    root = Path(root)
    doomed = [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)] if root.is_dir() else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return doomed


def _save_failure(root: Path, rollout_id: int, err: BaseException) -> str:
    """'could not save ... : No space left on device (12 KiB free) ...; the newest intact one ...'."""
    cause: BaseException = _first_os_error(err) or err  # the first OSError says what the disk said
    if isinstance(cause, OSError) and cause.strerror:
        why = cause.strerror
    else:
        why = f"{type(cause).__name__}: {cause}"
    try:
        free = f" ({shutil.disk_usage(root).free / 1024:.0f} KiB free there)"
    except OSError:
        free = ""
    intact = list_checkpoints(root) if root.is_dir() else []
    kept = (f"the checkpoints saved before are intact (newest: rollout {intact[-1][0]}, {intact[-1][1]})"
            if intact else "no earlier checkpoint exists")
    return (f"could not save the checkpoint of rollout {rollout_id} in {root}: {why}{free}; the partial save was "
            f"removed and {kept}. Free space on that volume (or point spec.model.save elsewhere) and run again: "
            "it resumes from the newest intact checkpoint")


def load_latest_checkpoint(
    root: str | os.PathLike, *, map_location: str | torch.device = "cpu"
) -> Checkpoint | None:
    """The newest checkpoint under `root` that is complete and matches its manifest, or None.

    Directories without a marker, with a missing, resized or altered file, or that fail to load
    are skipped with a `CheckpointSkippedWarning` naming the directory and the reason.
    `.tmp-` directories are never considered.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    for rollout_id, path in reversed(_rollout_dirs(root)):
        try:
            return load_checkpoint(path, map_location=map_location)
        except CorruptCheckpointError as err:
            message = f"skipping checkpoint {path}: {err}"
            log.warning(message)
            warnings.warn(message, CheckpointSkippedWarning, stacklevel=2)
    return None


def load_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Verify and load one checkpoint directory; raises CorruptCheckpointError saying why not."""
    path = Path(path)
    import torch

    manifest = verify_checkpoint(path)
    payload: dict[str, Any] = {}
    for key, filename in manifest["payload"].items():
        file = path / filename
        try:
            if filename.endswith(".json"):
                payload[key] = json.loads(file.read_text())
            else:
                payload[key] = torch.load(file, map_location=map_location, weights_only=True)
        except Exception as err:  # a file that hashes right but does not load is still unusable
            raise CorruptCheckpointError(f"{filename} does not load: {type(err).__name__}: {err}") from err
    return Checkpoint(rollout_id=int(manifest["rollout_id"]), path=path, payload=payload)


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint whose files all match it; raises otherwise."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        raise CorruptCheckpointError(f"no '{MARKER}' marker (the save did not finish)")
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
        payload = manifest["payload"]
        rollout_id = int(manifest["rollout_id"])
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(f"unreadable '{MARKER}' manifest: {err}") from err
    match = _DIR_RE.match(path.name)
    if match and int(match.group(1)) != rollout_id:
        raise CorruptCheckpointError(f"manifest says rollout {rollout_id}, directory name says {match.group(1)}")
    for filename in payload.values():
        if filename not in files:
            raise CorruptCheckpointError(f"manifest lists payload file {filename} without size and hash")
    for filename, expected in files.items():
        file = path / filename
        if not file.is_file():
            raise CorruptCheckpointError(f"{filename} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CorruptCheckpointError(f"{filename} has {size} bytes, manifest says {expected['bytes']}")
        digest = _sha256(file)
        if digest != expected["sha256"]:
            raise CorruptCheckpointError(f"{filename} sha256 {digest[:12]}… differs from the manifest's")
    return manifest


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(rollout_id, directory) of every checkpoint with a `complete` marker, oldest first.

    Only checks for the marker; `verify_checkpoint` checks the files.
    """
    return [(i, p) for i, p in _rollout_dirs(Path(root)) if (p / MARKER).is_file()]


def read_latest(root: str | os.PathLike) -> int | None:
    """The rollout id in `root/latest`, or None when there is none (a hint; loading scans)."""
    try:
        return int((Path(root) / LATEST).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def prune_checkpoints(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep`; returns what was deleted."""
    if keep < 1:
        raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
    doomed = [p for _, p in list_checkpoints(root)[:-keep]]
    for path in doomed:
        # Remove the marker first: an interrupted delete then reads as incomplete, not corrupt.
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        log.info("pruned checkpoint %s", path)
    return doomed


def clean_partial_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Delete `.tmp-` entries and checkpoint directories without a marker.

    Call at startup, before any save of this run: they are what crashed saves leave behind.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    unmarked = [p for _, p in _rollout_dirs(root) if not (p / MARKER).is_file()]
    for path in unmarked:
        shutil.rmtree(path, ignore_errors=True)
    doomed = remove_temporaries(root) + unmarked
    for path in doomed:
        log.info("removed partial checkpoint %s", path)
    return doomed


def _all_files(directory: Path) -> list[str]:
    """Every file under `directory`, as POSIX paths relative to it, sorted."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def _rollout_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():  # nothing saved yet
        return []
    found = []
    for p in root.iterdir():
        m = _DIR_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _is_plain_json(value: Any) -> bool:
    """True when JSON stores `value` exactly (tuples would come back as lists, so they don't count)."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_plain_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain_json(v) for k, v in value.items())
    return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory and os.replace, then fsync the directory."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{secrets.token_hex(4)}")
    _write_bytes(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
