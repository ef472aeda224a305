"""The tiny checkpoint, built once per distinct set of arguments and copied from a cache after.

Why: building it imports torch and transformers and initialises a model (about 4 CPU-seconds),
and it was the only reason `rlkube run`'s driver process loaded torch at all. The build is
deterministic (same arguments, same files), so a copy is the same checkpoint. The key holds the
arguments, this package's source and the torch and transformers versions (read from their
metadata, not imported), so a change to any of them builds afresh. Entries are written under a
temporary name and renamed whole; where the cache cannot be written, the checkpoint is built in
place as before.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def cache_root() -> Path:
    """$RLKUBE_CACHE_DIR, else $XDG_CACHE_HOME/rlkube, else ~/.cache/rlkube; tiny checkpoints under it."""
    explicit = os.environ.get("RLKUBE_CACHE_DIR")
    base = Path(explicit) if explicit else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlkube"
    return base / "tiny-models"


def checkpoint_key(**build_args) -> str:
    """What decides the files: the build's arguments, the code that builds them, the libraries it uses."""
    digest = hashlib.sha256(json.dumps(build_args, sort_keys=True).encode())
    for source in sorted(PACKAGE.glob("*.py")):
        digest.update(source.read_bytes())
    for library in ("torch", "transformers", "tokenizers", "safetensors"):
        digest.update(f"{library}={_version(library)}".encode())
    return digest.hexdigest()[:16]


def tiny_checkpoint(target: str | Path, *, root: Path | None = None, **build_args) -> Path:
    """`build_tiny_checkpoint(target, **build_args)`, from the cache when it holds that build."""
    from rlkube_runtime.tiny.model import build_tiny_checkpoint

    target = Path(target)
    entry = (root or cache_root()) / checkpoint_key(**build_args)
    if not (entry / "config.json").exists():
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        except OSError:  # a read-only home (a pod's): no cache, the build goes straight to the target
            return build_tiny_checkpoint(target, **build_args)
        try:
            build_tiny_checkpoint(staging, **build_args)
            staging.rename(entry)
        except OSError:
            if not (entry / "config.json").exists():  # not a concurrent build that got there first
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    target.mkdir(parents=True, exist_ok=True)
    # config.json last: the run takes a directory holding it for a complete checkpoint.
    for item in sorted(entry.iterdir(), key=lambda item: item.name == "config.json"):
        shutil.copy2(item, target / item.name)
    return target


def _version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
