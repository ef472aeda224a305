"""Every third-party module the code and its tests import comes from a distribution pyproject.toml declares.

Why: a package that arrives only through another one's dependencies works until that one drops it;
on a fresh machine (or in an image that installs one extra) the import then fails. The operator's
image installs the base and `operator` extra only, so its modules are checked against those alone.
"""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
OWN = "rlkube_"  # the project's packages, and the plugin modules its tests write
# Modules a declared distribution ships under another distribution's name, versioned in lockstep with it.
PART_OF = {"pydantic-core": "pydantic"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0))


def declared(*extras: str) -> set[str]:
    """Distributions the base dependencies and the named extras list (self-references expanded)."""
    names = {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    optional = PYPROJECT["project"]["optional-dependencies"]
    pending = list(extras)
    while pending:
        for requirement in optional[pending.pop()]:
            name = requirement_name(requirement)
            if name == "rlkube":
                pending.extend(re.search(r"\[(.*)\]", requirement).group(1).split(","))
            else:
                names.add(name)
    return names


def third_party_imports(package_dir: Path) -> dict[str, str]:
    """Top-level module -> the first file importing it, for every absolute import in the package."""
    found: dict[str, str] = {}
    files = sorted(package_dir.rglob("*.py"))
    local = {path.stem for path in files} | {path.parent.name for path in files}  # the tree's own helper modules
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and not top.startswith(OWN) and top not in local:
                    found.setdefault(top, str(path.relative_to(package_dir.parent)))
    return found


def undeclared(package_dir: Path, allowed: set[str]) -> list[str]:
    providers = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(third_party_imports(package_dir).items()):
        dists = {canonical(d) for d in providers.get(module, ())}
        if not dists:
            problems.append(f"{module} (imported by {where}) is not installed: declare the distribution that provides it")
        elif not {PART_OF.get(d, d) for d in dists} & allowed:
            problems.append(f"{module} (imported by {where}) comes from {sorted(dists)}, which pyproject.toml does not declare")
    return problems


@pytest.mark.parametrize(("package", "extras"), [
    ("runtime/rlkube_runtime", ("runtime", "operator", "megatron", "tracking", "tensorboard", "sglang")),
    ("operator/rlkube_operator", ("operator",)),
    ("tests", ("dev", "sglang")),  # the sglang wheel goes in beside dev (scripts/venv.py: --no-deps)
])
def test_every_imported_distribution_is_declared(package, extras):
    assert undeclared(REPO / package, declared(*extras)) == []


def test_the_check_sees_an_undeclared_import(tmp_path):
    (tmp_path / "mod.py").write_text("import yaml\nfrom torch import nn\nimport json\n")
    assert third_party_imports(tmp_path) == {"yaml": f"{tmp_path.name}/mod.py", "torch": f"{tmp_path.name}/mod.py"}
    problems = undeclared(tmp_path, declared())
    assert len(problems) == 1 and problems[0].startswith("torch (imported by") and "does not declare" in problems[0]
    assert declared("dev") >= {"torch", "kopf", "pytest", "megatron-core"}
