"""The README names only what the code has: environment variables, metrics, conditions, reasons and flags.

Pure: it reads README.md, imports the modules that define the names and builds the command-line parsers
(no process, no server). A renamed flag, metric or variable fails here until the README follows.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from oobleck.api.conditions import ConditionType, Reason
from oobleck.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CODE_FOLDERS = ("src", "operator", "runtime", "planner_cy", "simulator", "devtools", "tests")


def section(title: str) -> str:
    """The text of the README's `## title` section, up to the next `## ` heading."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def code_literals() -> set[str]:
    """Every quoted string literal's text in the Python sources (product, dev tooling, tests)."""
    found: set[str] = set()
    for folder in CODE_FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            found.update(re.findall(r"[\"']([A-Z][A-Z0-9_]+)[\"']", path.read_text()))
    return found


def test_every_environment_variable_the_readme_names_is_read_by_the_code() -> None:
    named = set(re.findall(r"\b(?:OOBLECK|WORKER)_[A-Z0-9_]+\b", README))
    assert named, "the README names no environment variable: the pattern is stale"
    missing = sorted(named - code_literals())
    assert not missing, f"README names environment variables no code reads: {missing}"


def exposed_metric_names() -> set[str]:
    """The names a scrape shows (counters with their `_total`), from the worker's and the operator's registries."""
    from oobleck.operator.metrics import Metrics
    from oobleck.runtime.train.metrics import WorkerMetrics

    names: set[str] = set()
    for registry in (WorkerMetrics("job", "node", 0).registry, Metrics().registry):
        for family in registry.collect():
            names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def test_every_metric_the_readme_names_is_exported() -> None:
    named = set(re.findall(r"\boobleck_(?:worker|operator)_[a-z_]+[a-z]", README))
    assert len(named) >= 10, "the README's metrics were not found"
    missing = sorted(named - exposed_metric_names())
    assert not missing, f"README names metrics the code does not export: {missing}"


def test_the_metrics_table_lists_every_exported_metric() -> None:
    table = section("Metrics")
    unlisted = sorted(name for name in exposed_metric_names() if f"`{name}" not in table)
    assert not unlisted, f"metrics missing from the README's Metrics table: {unlisted}"


def test_the_conditions_and_failure_reasons_the_readme_names_exist() -> None:
    text = section("The operator")
    listed = re.search(r"Conditions: ([A-Za-z, ]+) \(reasons in", text)
    assert listed is not None, "the operator section's list of conditions was not found"
    conditions = {name.strip() for name in listed.group(1).split(",")}
    assert conditions == {c.value for c in ConditionType}, "the README's conditions differ from ConditionType"
    reasons = {value for name, value in vars(Reason).items() if name.isupper()}
    kinds = re.search(r"fails the job with the kind as the reason \(([A-Za-z, \n]+)\)", text)
    assert kinds is not None, "the operator section's list of failure reasons was not found"
    named = {name.strip() for name in kinds.group(1).split(",")}
    for reason in ("ChildRejected", "InvalidSpec", "PlanUnreadable", "ReportTooLarge", "WorkerFailed"):
        assert reason in text, f"{reason} is no longer in the README's operator section"
        named.add(reason)
    assert not named - reasons, f"README names reasons not in oobleck.api.conditions.Reason: {named - reasons}"


def flags_of(command: str) -> set[str]:
    subparsers = next(
        action for action in build_parser(command)._actions if action.dest == "command" and action.choices
    )
    assert subparsers.choices is not None
    return set(subparsers.choices[command]._option_string_actions)


def readme_command_lines() -> list[tuple[str, str]]:
    """(command, its line) for every `oobleck COMMAND ...` line of the README's code blocks."""
    blocks = re.findall(r"^```\n(.*?)^```", README, flags=re.M | re.S)
    lines: list[tuple[str, str]] = []
    for block in blocks:
        for line in block.splitlines():
            for part in line.split("#", 1)[0].split(";"):
                match = re.match(r"\s*oobleck (\w+)\b(.*)", part)
                if match is not None:
                    lines.append((match.group(1), match.group(2)))
    return lines


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_readme_s_command_lines_use_flags_the_command_has(command: str) -> None:
    lines = [rest for name, rest in readme_command_lines() if name == command]
    named = {flag for rest in lines for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest)}
    missing = sorted(named - flags_of(command))
    assert not missing, f"README's `oobleck {command}` lines name flags it does not have: {missing}"


@pytest.mark.parametrize(
    ("title", "command"), [("The operator", "operator"), ("Training and recovery (runtime)", "launch")]
)
def test_the_flags_a_section_names_belong_to_its_command(title: str, command: str) -> None:
    text = section(title).split("\n- ", 1)[0]  # the text before the bullets (stragglers' bench flags follow)
    named = set(re.findall(r"`(--[a-z][a-z-]*)", text))
    named |= {flag for span in re.findall(r"`([^`]*--[^`]*)`", text) for flag in re.findall(r"--[a-z][a-z-]*", span)}
    assert named, f"no flag found in the README's {title!r} section"
    missing = sorted(named - flags_of(command))
    assert not missing, f"README's {title!r} section names flags `oobleck {command}` does not have: {missing}"


def dev_flags() -> dict[str, set[str]]:
    """`python -m oobleck_dev`'s subcommands and their flags."""
    import argparse

    from oobleck_dev import cli, demo

    subparsers = argparse.ArgumentParser().add_subparsers()
    cli.register(subparsers)
    demo.register(subparsers)
    return {name: set(parser._option_string_actions) for name, parser in subparsers.choices.items()}


def test_the_readme_s_dev_tooling_lines_name_commands_and_flags_that_exist() -> None:
    commands = dev_flags()
    named = re.findall(r"python -m oobleck_dev ([a-z-]+)([^;#`\n]*)", README)
    assert len(named) >= 5, "the README's oobleck_dev lines were not found"
    wrong = []
    for command, rest in named:
        if command not in commands:
            wrong.append(command)
            continue
        wrong += [f"{command} {flag}" for flag in re.findall(r"--[a-z][a-z-]*", rest) if flag not in commands[command]]
    assert not wrong, f"README names oobleck_dev commands or flags that do not exist: {wrong}"
