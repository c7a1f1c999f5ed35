"""The `oobleck` dispatcher: every listed command exists in the module that is said to own it."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from oobleck.cli import COMMANDS

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_is_registered_by_its_module(command: str) -> None:
    module, _ = COMMANDS[command]
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    importlib.import_module(module).register(subparsers)
    assert command in subparsers.choices, f"{module} does not register `{command}`"


def test_every_registered_command_is_listed() -> None:
    registered: set[str] = set()
    for module in {module for module, _ in COMMANDS.values()}:
        subparsers = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(subparsers)
        registered |= set(subparsers.choices)
    assert registered == set(COMMANDS)


def test_unknown_command_exits_2_naming_the_choices() -> None:
    result = subprocess.run([sys.executable, "-m", "oobleck.cli", "nope"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "invalid choice: 'nope'" in result.stderr and "plan" in result.stderr


def test_planner_commands_do_not_import_torch_or_kopf() -> None:
    code = "import sys; from oobleck.cli import main; main(['crds']); print(sorted(m for m in ('torch', 'kopf') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "args, message",
    [
        (["operator", "-n", "x", "--measure-timeout", "-1"], "--measure-timeout must be >= 0, got -1.0"),
        (["operator", "-n", "x", "--batch-window", "-0.5"], "--batch-window must be >= 0, got -0.5"),
        (["operator", "-n", "x", "--silent-node-grace", "-5"], "--silent-node-grace must be >= 0, got -5.0"),
        (["launch", "--nodes", "2", "--controller", "guess"], "invalid choice: 'guess'"),
    ],
)
def test_bad_flags_of_new_options_exit_2_naming_the_flag(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "oobleck.cli", *args], capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr, result.stderr
