"""`oobleck` command line: one subcommand per component, each defined beside its component.

Every subcommand module exposes `register(subparsers)`, which adds its parsers and sets
`func(args) -> int`. Only the module owning the command being run is imported, so one component's
import cost (torch, kopf) or breakage never reaches another's commands. Invalid input exits 2 with
a message naming the argument or field.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module that registers it, one-line help shown by `oobleck --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("oobleck.planner.cli", "plan templates, instantiation and batch split; preview a reconfiguration"),
    "crds": ("oobleck.api.cli", "print, write or check the CRD YAML generated from the API models"),
    "worker": ("oobleck.runtime.cli", "run one training worker"),
    "profile": ("oobleck.runtime.cli", "measure every layer and write the planner's profile JSON"),
    "tokenize": (
        "oobleck.runtime.models.tokenizing",
        "encode a text file into a token file with a tokenizers JSON file",
    ),
    "launch": (
        "oobleck.runtime.backends.local.cli",
        "run an elastic job locally: coordinator, plan controller, workers",
    ),
    "operator": ("oobleck.operator.cli", "run the OobleckJob operator (kopf)"),
    "simulate": (
        "oobleck.simulate.cli",
        "goodput under failure traces: oobleck vs checkpoint-restart, Bamboo, torchft",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser for `command`'s module, or a summary of every command when `command` is None."""
    parser = argparse.ArgumentParser(prog="oobleck", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command in COMMANDS:
        importlib.import_module(COMMANDS[command][0]).register(subparsers)
    else:
        for name, (_, help) in COMMANDS.items():
            subparsers.add_parser(name, help=help, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
