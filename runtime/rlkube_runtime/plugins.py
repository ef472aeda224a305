"""Load user code named by a path string, and call it whether it is sync or async.

A spec names user code as `package.module:attribute` (the attribute may be dotted, e.g.
`mymod:Scorer.score`); the dotted form `package.module.attribute` is accepted too. Custom reward
functions, group reward functions, custom generate functions and dynamic sampling filters all go
through `load_callable`, so every plugin fails the same way: with the path, the step that failed
and what to check.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


class PluginLoadError(ImportError):
    """The path in a spec does not name an importable callable."""


def load_callable(path: str, *, what: str = "plugin") -> Callable[..., Any]:
    """Import the callable named by `path`; `what` names its role in error messages.

    Raises PluginLoadError when the path is malformed, the module does not import, the attribute
    is missing or the object is not callable.
    """
    module_name, attr_path = _split_path(path, what)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail with anything while importing
        raise PluginLoadError(
            f"{what} {path!r}: importing module {module_name!r} failed with "
            f"{type(exc).__name__}: {exc}. Check that the module is installed or on PYTHONPATH "
            "in the runtime image and imports cleanly."
        ) from exc
    for i, part in enumerate(attr_path):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            owner = ".".join([module_name, *attr_path[:i]])
            raise PluginLoadError(
                f"{what} {path!r}: {owner!r} has no attribute {part!r}. "
                "Check the spelling after the ':'."
            ) from exc
    if not callable(obj):
        raise PluginLoadError(
            f"{what} {path!r} names a {type(obj).__name__}, not a function or callable object."
        )
    return obj


async def call_plugin(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call `fn` and await its result when it returns an awaitable (async def or coroutine)."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


def _split_path(path: str, what: str) -> tuple[str, list[str]]:
    if not isinstance(path, str) or not path.strip():
        raise PluginLoadError(
            f"{what}: expected a path like 'package.module:function', got {path!r}."
        )
    path = path.strip()
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    parts = attr.split(".") if attr else []
    if not module_name or not parts or not all(p.isidentifier() for p in parts):
        raise PluginLoadError(
            f"{what}: expected a path like 'package.module:function', got {path!r}."
        )
    return module_name, parts
