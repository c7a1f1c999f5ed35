"""`oobleck crds`: print the generated CRDs, write them to a folder, or check a folder for drift."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `crds` subcommand."""
    parser = subparsers.add_parser("crds", help="print, write (--write DIR) or check (--check DIR) the CRD YAML")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="DIR", type=Path, help="write the CRD files into DIR")
    group.add_argument("--check", metavar="DIR", type=Path, help="exit 1 if DIR's CRD files differ from the models")
    parser.set_defaults(func=run)


def drift(folder: Path, expected: dict[str, str]) -> list[str]:
    """Names of the files in `folder` that are missing or differ from `expected`."""
    return [
        name for name, text in expected.items() if not (folder / name).is_file() or (folder / name).read_text() != text
    ]


def run(args: argparse.Namespace) -> int:
    from oobleck.api.crd import render_files

    files = render_files()
    if args.write is not None:
        args.write.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (args.write / name).write_text(text)
            print(f"wrote {args.write / name}")
        return 0
    if args.check is not None:
        stale = drift(args.check, files)
        for name in stale:
            print(
                f"{args.check / name}: differs from the models in src/oobleck/api/; run `make crds`",
                file=sys.stderr,
            )
        return 1 if stale else 0
    sys.stdout.write("---\n".join(files.values()))
    return 0
