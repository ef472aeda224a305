"""Every exception class rlkube defines survives pickling with its message and fields, so an
error raised inside a Ray actor reaches the terminal as itself, not as UnserializableException."""

import importlib
import inspect
import pickle
import pkgutil

import pytest

import rlkube_operator
import rlkube_runtime

# Modules that need an optional dependency this environment may lack are skipped by name.
SKIP_MODULES = ()


def _exception_classes():
    found = {}
    for package in (rlkube_runtime, rlkube_operator):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__") or info.name in SKIP_MODULES:
                continue
            module = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                    found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def _example_arguments(cls):
    """One value per required __init__ parameter, typed after its annotation."""
    if cls.__init__ is BaseException.__init__ or cls.__init__ is Exception.__init__:
        return ("something failed",)
    args = []
    for parameter in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.default is not parameter.empty:
            continue
        annotation = str(parameter.annotation)
        if "int" in annotation:
            args.append(503)
        elif "list" in annotation.lower() or "ErrorList" in annotation:
            args.append([("spec.rollout.batchSize", "must be >= 1")])
        else:
            args.append(f"value of {parameter.name}")
    return tuple(args)


CLASSES = _exception_classes()


def test_the_walk_finds_the_errors_that_cross_ray():
    assert {"rlkube_runtime.serving.client.EngineHTTPError", "rlkube_runtime.engine.protocol.ProtocolError",
            "rlkube_runtime.spec.load.SpecError", "rlkube_runtime.actors.engine_pool.EngineRestartLimitExceeded"} <= set(CLASSES)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_exception_round_trips_through_pickle(name):
    cls = CLASSES[name]
    error = cls(*_example_arguments(cls))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls and str(copy) == str(error)
    for field in ("status", "message", "url", "field", "errors", "source"):
        if hasattr(error, field):
            assert getattr(copy, field) == getattr(error, field)
