"""The pinned SGLang wheel, installed for its Python code only (argument parser, sampling params,
frontend client): `pip install --no-deps sglang==SGLANG_VERSION` plus the dev extra's small
modules its imports need. Its full dependencies would pull a CUDA torch build, so `pip install
-e .[dev]` cannot bring it; `make test` installs it with --no-deps."""

from __future__ import annotations

import importlib.metadata

import pytest

from rlkube_runtime.serving.sglang_args import SGLANG_VERSION

INSTALL = f"pip install --no-deps sglang=={SGLANG_VERSION}"


def require_pinned_sglang() -> None:
    """Fail (not skip: a skipped conformance test would hide drift) unless the pinned sglang is installed."""
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"sglang is not installed; these tests read the pinned release's own code: {INSTALL}")
    if installed != SGLANG_VERSION:
        pytest.fail(f"sglang {installed} is installed but rlkube pins {SGLANG_VERSION} (sglang_args.SGLANG_VERSION): {INSTALL}")
