"""load_callable / call_plugin: user code named by 'package.module:function', sync or async."""

import itertools
import textwrap

import pytest
from rlkube_runtime.plugins import PluginLoadError, call_plugin, load_callable

_names = itertools.count()


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """write(source) creates a real importable module and returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"rlkube_test_plugin_{next(_names)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def test_colon_and_dotted_paths_load_the_same_function(plugin_module):
    mod = plugin_module("def score(x):\n    return x + 1\n")
    assert load_callable(f"{mod}:score")(1) == 2
    assert load_callable(f"{mod}.score") is load_callable(f"{mod}:score")


def test_an_attribute_path_after_the_colon_may_be_dotted(plugin_module):
    mod = plugin_module(
        "class Scorer:\n    @staticmethod\n    def score(x):\n        return 2 * x\n"
    )
    assert load_callable(f"{mod}:Scorer.score")(3) == 6


def test_a_module_that_does_not_import_is_named_with_the_cause(plugin_module):
    with pytest.raises(
        PluginLoadError,
        match=r"custom reward 'no_such_mod_x:f': importing module 'no_such_mod_x' failed with ModuleNotFoundError",
    ):
        load_callable("no_such_mod_x:f", what="custom reward")


def test_an_error_raised_while_importing_the_module_is_reported(plugin_module):
    mod = plugin_module("raise RuntimeError('needs GPU')\n")
    with pytest.raises(
        PluginLoadError, match=rf"importing module '{mod}' failed with RuntimeError: needs GPU"
    ):
        load_callable(f"{mod}:f")


def test_a_missing_attribute_names_the_owner_and_the_attribute(plugin_module):
    mod = plugin_module("class A:\n    pass\n")
    with pytest.raises(PluginLoadError, match=rf"'{mod}.A' has no attribute 'b'"):
        load_callable(f"{mod}:A.b")


def test_a_non_callable_target_is_refused(plugin_module):
    mod = plugin_module("THRESHOLD = 3\n")
    with pytest.raises(PluginLoadError, match=rf"'{mod}:THRESHOLD' names a int, not a function"):
        load_callable(f"{mod}:THRESHOLD")


@pytest.mark.parametrize(
    "path", ["", "   ", "justaname", "mod:", ":f", "mod:not-an-identifier", None]
)
def test_a_malformed_path_is_refused_with_the_expected_form(path):
    with pytest.raises(PluginLoadError, match="expected a path like 'package.module:function'"):
        load_callable(path)


async def test_call_plugin_awaits_async_functions_and_returns_sync_results():
    async def async_fn(x):
        return x * 2

    assert await call_plugin(async_fn, 4) == 8
    assert await call_plugin(lambda x, y=0: x + y, 4, y=1) == 5
