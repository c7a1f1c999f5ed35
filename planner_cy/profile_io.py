"""Read and write model profiles as JSON files (the planner itself never does I/O; its callers use this).

Errors name the file and, for invalid content, every offending field with its JSON path, e.g.
`profile.json: layers.3.forward_ms: Input should be greater than or equal to 0`.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from oobleck.api.profile import ModelProfile


class ProfileError(ValueError):
    """A profile file that cannot be read or does not match the ModelProfile schema."""


def parse_profile(text: str, source: str = "profile") -> ModelProfile:
    """Validate a profile from JSON text; `source` names it in errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileError(f"{source}: not JSON: {error}") from error
    try:
        return ModelProfile.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc']) or '(top level)'}: {problem['msg']}"
            for problem in error.errors()
        )
        raise ProfileError(f"{source}: {problems}") from error


def load_profile(path: str | Path) -> ModelProfile:
    """Read and validate a profile JSON file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ProfileError(f"{path}: cannot read: {error.strerror or error}") from error
    return parse_profile(text, str(path))


def dump_profile(profile: ModelProfile) -> str:
    """Canonical JSON (indented, fields in schema order): the same profile always gives the same text."""
    return profile.model_dump_json(indent=2) + "\n"


def save_profile(profile: ModelProfile, path: str | Path) -> None:
    """Write a profile as canonical JSON, replacing the file atomically."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(dump_profile(profile))
    partial.replace(path)
