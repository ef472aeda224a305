"""One SGLang / sglang-router pair everywhere: the runtime's constants, pyproject.toml's extras, the
rollout image's base tag, and what is installed here (what the conformance tests read)."""

import importlib.metadata
import re
import tomllib  # the test environment is Python 3.11+ (CI's is 3.11)

from example_launch_lines import ROOT
from packaging.requirements import Requirement

from rlkube_runtime.serving.sglang_args import SGLANG_ROUTER_VERSION, SGLANG_VERSION


def _extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _pins(requirements: list[str], name: str) -> list[str]:
    """The versions `requirements` pin `name` to with `==` ('' for a requirement of `name` that is not such a pin)."""
    found = []
    for requirement in map(Requirement, requirements):
        if requirement.name == name:
            specs = list(requirement.specifier)
            exact = len(specs) == 1 and specs[0].operator == "=="
            found.append(specs[0].version if exact else "")
    return found


def test_the_sglang_extra_pins_the_runtimes_sglang_version():
    assert _pins(_extras()["sglang"], "sglang") == [SGLANG_VERSION]


def test_the_runtime_extra_pins_the_runtimes_router_version():
    assert _pins(_extras()["runtime"], "sglang-router") == [SGLANG_ROUTER_VERSION]


def test_no_other_extra_names_a_different_sglang_or_router():
    for extra, requirements in _extras().items():
        assert set(_pins(requirements, "sglang")) <= {SGLANG_VERSION}, extra
        assert set(_pins(requirements, "sglang-router")) <= {SGLANG_ROUTER_VERSION}, extra


def test_the_rollout_image_is_built_on_the_pinned_sglang_release():
    dockerfile = (ROOT / "Dockerfile.rollout").read_text()
    tags = re.findall(r"lmsysorg/sglang:v(\d+\.\d+\.\d+(?:\.post\d+)?)", dockerfile)
    assert tags == [SGLANG_VERSION], f"Dockerfile.rollout bases on {tags}, the runtime pins {SGLANG_VERSION}"
    # The router comes from the `runtime` extra (pinned above), not from whatever the base image has.
    assert 'pip install ".[runtime]"' in dockerfile


def test_the_makefile_installs_the_pinned_sglang_when_it_installs_one():
    pins = re.findall(r"sglang==([\w.]+)", (ROOT / "Makefile").read_text())
    assert set(pins) <= {SGLANG_VERSION}, f"Makefile installs sglang {pins}, the runtime pins {SGLANG_VERSION}"


def test_the_installed_router_is_the_pinned_one():
    assert importlib.metadata.version("sglang-router") == SGLANG_ROUTER_VERSION


def _constraints() -> dict[str, Requirement]:
    lines = (ROOT / "images" / "sglang-pins.txt").read_text().splitlines()
    return {r.name: r for r in (Requirement(line) for line in lines if line.strip() and not line.startswith("#"))}


def test_the_images_constraints_are_what_the_pinned_sglang_itself_pins():
    # The trainer and rollout images install the runtime under images/sglang-pins.txt; a version
    # there that sglang does not pin would change what the images hold.
    sglang_pins = {r.name: r for r in map(Requirement, importlib.metadata.requires("sglang") or []) if r.marker is None}
    assert importlib.metadata.version("sglang") == SGLANG_VERSION
    for name, constraint in _constraints().items():
        assert name in sglang_pins, f"images/sglang-pins.txt constrains {name}, which sglang {SGLANG_VERSION} does not pin"
        assert constraint.specifier == sglang_pins[name].specifier, (name, str(constraint), str(sglang_pins[name]))


def test_the_images_constrain_every_runtime_dependency_sglang_pins_exactly():
    # Otherwise the trainer's sglang layer would replace a version the shared runtime layer installed.
    runtime = {Requirement(r).name for r in _extras()["runtime"]}
    sglang_exact = {r.name for r in map(Requirement, importlib.metadata.requires("sglang") or [])
                    if r.marker is None and _pins([str(r)], r.name) != [""]}
    assert runtime & sglang_exact == set(_constraints())
