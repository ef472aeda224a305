"""The job's API key on the client side: the router and every engine of a job on Kubernetes require
it (`Authorization: Bearer <key>`) for generation and every weight and admin endpoint; health and
metrics stay open, as in SGLang. The operator puts it in every pod as RLKUBE_API_KEY (from the
Secret it generates per RLJob); a local run has none, and its engines and router then serve on
loopback without one."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from rlkube_runtime.spec.contract import ENV_API_KEY

API_KEY_FLAG = "--api-key"
_REDACTED = "<redacted>"


def job_api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The job's API key from the environment, None where there is none."""
    return (os.environ if environ is None else environ).get(ENV_API_KEY) or None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redacted(command: Sequence[str]) -> list[str]:
    """`command` with the value of every --api-key (and --admin-api-key) hidden, for logs."""
    out: list[str] = []
    hide = False
    for word in command:
        if hide:
            out.append(_REDACTED)
            hide = False
        elif word in (API_KEY_FLAG, "--admin-api-key"):
            out.append(word)
            hide = True
        elif word.startswith((API_KEY_FLAG + "=", "--admin-api-key=")):
            out.append(word.split("=", 1)[0] + "=" + _REDACTED)
        else:
            out.append(word)
    return out
