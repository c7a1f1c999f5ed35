"""The structure contracts: small product modules, short functions (issue 18).

A product module (the installed packages: src/oobleck, operator, runtime, planner_cy, simulator) stays
within MAX_MODULE_LINES; a function or method within MAX_FUNCTION_LINES, unless a `# long:` comment in
its body says why it is better whole. Pure: it parses the sources, runs nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("src/oobleck", "operator", "runtime", "planner_cy", "simulator")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
JUSTIFIED = "# long:"


def product_sources(suffix: str = ".py") -> list[Path]:
    return sorted(path for folder in PRODUCT for path in (REPO / folder).rglob(f"*{suffix}"))


def long_functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of the functions in `path` over MAX_FUNCTION_LINES without a `# long:` comment."""
    source = path.read_text()
    lines = source.splitlines()
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    length = child.end_lineno - first + 1
                    body = lines[first - 1 : child.end_lineno]
                    if length > MAX_FUNCTION_LINES and not any(JUSTIFIED in line for line in body):
                        found.append((name, length))
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return found


def test_the_product_has_sources() -> None:
    names = {path.name for path in product_sources()}
    assert {"decide.py", "spec.py", "engine.py", "cli.py"} <= names


def test_every_product_module_is_short() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in (*product_sources(), *product_sources(".pyx"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


def test_every_function_is_short_or_says_why() -> None:
    long = {f"{path.relative_to(REPO)}:{name}": n for path in product_sources() for name, n in long_functions(path)}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines without a `{JUSTIFIED} <why>` comment: " + ", ".join(
        f"{k} ({v})" for k, v in sorted(long.items(), key=lambda kv: -kv[1])
    )


def test_the_check_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = tmp_path / "sample.py"
    source.write_text(f"class A:\n    def f(self):\n{body}\n\n    def g(self):\n        # long: one table\n{body}\n")
    assert long_functions(source) == [("A.f", MAX_FUNCTION_LINES + 1)]


def test_the_readme_layout_names_only_modules_that_exist() -> None:
    """Every file a row of the README's layout table names is in that row's folder (or at that path)."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Layout") : readme.index("## Architecture")]
    rows = re.findall(r"^\| `([^`]+/)` \|[^|]*\|(.*)\|$", table, flags=re.M)
    assert len(rows) >= 10, "the layout table was not found"
    missing = []
    for folder, what in rows:
        for name in re.findall(r"`([A-Za-z0-9_/.-]+\.(?:py|pyx|pxd|yaml))`", what):
            if name == "__init__.py":  # named where a folder has none on purpose (operator/)
                continue
            if not ((REPO / name).exists() or any((REPO / folder).rglob(name))):
                missing.append(f"{folder}: {name}")
    assert not missing, f"README layout names files not in the tree: {missing}"
