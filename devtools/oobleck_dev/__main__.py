"""`python -m oobleck_dev`: the local cluster, local nodes and the demo (development tooling).

This package is installed into the checkout's environment by `make` (scripts/venv) for the tests and
the demo; it is not part of the product package or the image.
"""

from __future__ import annotations

import argparse
import sys

from oobleck_dev import cli, demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck_dev", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cli.register(subparsers)
    demo.register(subparsers)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
