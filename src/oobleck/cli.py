"""`oobleck` command line: one subcommand per component, each defined beside its component.

Every subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. Invalid input exits 2 with a message naming the argument or field.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add subcommands. Each keeps heavy imports (torch, kopf) inside its `func`, so that
# `oobleck plan` stays fast.
SUBCOMMANDS: list[str] = []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oobleck", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
