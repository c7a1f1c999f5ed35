"""Keep the Helm chart's generated parts in step with their sources.

The chart cannot read files outside its folder, so it carries copies: `files/crds/` holds the
repository's `crds/` byte for byte (generated from the pydantic models), and Chart.yaml's
`appVersion` is pyproject's `project.version`. Nobody edits those by hand:

    python -m oobleck_dev.chart --write   # copy crds/ into the chart, set appVersion
    python -m oobleck_dev.chart --check   # exit 1 and name every difference (tests/helm runs this)
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

CHART_PATH = Path("charts") / "oobleck-operator"
CRDS_PATH = Path("crds")
CHART_CRDS_PATH = CHART_PATH / "files" / "crds"
APP_VERSION = re.compile(r'^appVersion:\s*"?([^"\s]*)"?\s*$', re.MULTILINE)


@dataclass(frozen=True)
class Sync:
    """What the chart's generated parts should be, read from the repository at `root`."""

    root: Path

    @property
    def chart(self) -> Path:
        return self.root / CHART_PATH

    def crds(self) -> dict[str, bytes]:
        """File name -> content of every CRD in the repository's crds/."""
        source = self.root / CRDS_PATH
        files = {path.name: path.read_bytes() for path in sorted(source.glob("*.yaml"))}
        if not files:
            raise FileNotFoundError(f"{source}: no CRD files (run `make crds`)")
        return files

    def version(self) -> str:
        """pyproject.toml's project.version."""
        with open(self.root / "pyproject.toml", "rb") as handle:
            return str(tomllib.load(handle)["project"]["version"])

    def chart_app_version(self) -> str | None:
        match = APP_VERSION.search((self.chart / "Chart.yaml").read_text())
        return match.group(1) if match else None

    def drift(self) -> list[str]:
        """One message per difference between the chart and its sources (empty: in step)."""
        problems = []
        copies = self.root / CHART_CRDS_PATH
        expected = self.crds()
        for name, content in expected.items():
            copy = copies / name
            if not copy.is_file():
                problems.append(f"{copy.relative_to(self.root)}: missing (a copy of {CRDS_PATH / name})")
            elif copy.read_bytes() != content:
                problems.append(f"{copy.relative_to(self.root)}: differs from {CRDS_PATH / name}")
        for extra in sorted(copies.glob("*.yaml")):
            if extra.name not in expected:
                problems.append(f"{extra.relative_to(self.root)}: no such CRD in {CRDS_PATH}/ (stale copy)")
        app_version, version = self.chart_app_version(), self.version()
        if app_version != version:
            problems.append(
                f"{CHART_PATH / 'Chart.yaml'}: appVersion {app_version!r} != pyproject.toml version {version!r}"
            )
        return problems

    def write(self) -> list[str]:
        """Bring the chart in step; returns the paths written."""
        written = []
        copies = self.root / CHART_CRDS_PATH
        copies.mkdir(parents=True, exist_ok=True)
        expected = self.crds()
        for name, content in expected.items():
            copy = copies / name
            if not copy.is_file() or copy.read_bytes() != content:
                copy.write_bytes(content)
                written.append(str(copy.relative_to(self.root)))
        for extra in copies.glob("*.yaml"):
            if extra.name not in expected:
                extra.unlink()
                written.append(f"{extra.relative_to(self.root)} (removed)")
        chart_yaml = self.chart / "Chart.yaml"
        text = chart_yaml.read_text()
        if APP_VERSION.search(text) is None:
            raise ValueError(f"{chart_yaml}: no appVersion line to update")
        updated = APP_VERSION.sub(f'appVersion: "{self.version()}"', text, count=1)
        if updated != text:
            chart_yaml.write_text(updated)
            written.append(str(chart_yaml.relative_to(self.root)))
        return written


def find_root(start: Path | None = None) -> Path:
    """The repository root: the nearest folder above `start` (default: the working directory) with
    both pyproject.toml and the chart."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / CHART_PATH / "Chart.yaml").is_file():
            return folder
    raise FileNotFoundError(f"no repository root with {CHART_PATH}/Chart.yaml above {here}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck_dev.chart", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 if the chart's copies differ from their sources")
    mode.add_argument("--write", action="store_true", help="copy crds/ into the chart and set appVersion")
    parser.add_argument(
        "--root", type=Path, default=None, help="repository root (default: found from the working directory)"
    )
    args = parser.parse_args(argv)
    try:
        sync = Sync(args.root.resolve() if args.root else find_root())
        if args.write:
            for path in sync.write():
                print(f"wrote {path}")
            return 0
        problems = sync.drift()
    except (FileNotFoundError, ValueError, KeyError) as error:
        print(f"oobleck_dev.chart: {error}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"{problem}; run `python -m oobleck_dev.chart --write`", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
