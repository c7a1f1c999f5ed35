"""The build and layout contracts: import names, no stdlib shadowing, a loud compiled planner."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import oobleck.planner

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)


REPO = Path(__file__).resolve().parents[1]
PLANNER_SOURCES = REPO / "planner_cy"


def run_python(code: str, cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:
        # PYTHONPATH comes before site-packages (and the editable link tree), so the copy wins.
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_operator_folder_does_not_shadow_the_standard_library() -> None:
    # `python -c` from the repository root puts the root first on sys.path.
    assert not (REPO / "operator" / "__init__.py").exists(), "operator/ must stay a namespace folder"
    result = run_python("import collections, operator; print(operator.eq(1, 1))", cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_components_import_under_the_oobleck_namespace() -> None:
    result = run_python("import oobleck.planner, oobleck.runtime, oobleck.api.plan, oobleck.cli; print('ok')", cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_compiled_planner_modules_are_the_expected_ones() -> None:
    assert oobleck.planner.COMPILED_MODULES == ("_instantiate", "_templates")
    for name in oobleck.planner.COMPILED_MODULES:
        module = sys.modules[f"oobleck.planner.{name}"]
        assert module.__file__.endswith(".so"), f"{name} is not compiled: {module.__file__}"


def _copy_planner_package(root: Path) -> Path:
    """A private copy of the oobleck.planner package (sources + built extensions) under `root`."""
    package = root / "oobleck"
    shutil.copytree(REPO / "src" / "oobleck", package, ignore=shutil.ignore_patterns("__pycache__"))
    planner = package / "planner"
    shutil.copytree(PLANNER_SOURCES, planner, ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    return planner


def test_stale_compiled_planner_is_a_loud_import_error(tmp_path: Path) -> None:
    planner = _copy_planner_package(tmp_path)
    source = planner / "_templates.pyx"
    source.write_text(source.read_text() + "\n# edited after the build\n")
    result = run_python("import oobleck.planner", cwd=tmp_path, extra_path=tmp_path)
    assert result.returncode != 0
    assert "is stale" in result.stderr and "make build" in result.stderr


@pytest.mark.parametrize("module", ["_templates", "_instantiate"])
def test_missing_compiled_planner_is_a_loud_import_error(tmp_path: Path, module: str) -> None:
    planner = _copy_planner_package(tmp_path)
    for built in planner.glob(f"{module}.*.so"):
        built.unlink()
    result = run_python("import oobleck.planner", cwd=tmp_path, extra_path=tmp_path)
    assert result.returncode != 0
    assert f"oobleck.planner.{module}) is missing" in result.stderr


def test_the_readme_layout_names_every_runtime_package() -> None:
    """The README's layout table matches the tree: every runtime package is a row, and every row's folder exists."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Layout") : readme.index("## Architecture")]
    packages = sorted(str(init.parent.relative_to(REPO)) + "/" for init in (REPO / "runtime").glob("*/__init__.py"))
    assert packages, "runtime has no sub-packages"
    missing = [package for package in packages if f"| `{package}` |" not in table]
    assert not missing, f"README layout table lacks {missing}"
    import re

    for folder in re.findall(r"^\| `([^`]+/)` \|", table, flags=re.M):
        assert (REPO / folder).is_dir(), f"README layout names {folder}, which is not in the tree"
