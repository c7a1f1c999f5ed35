"""oobleck.planner: pipeline templates, instantiation, batch distribution and reconfiguration.

The compiled core (the `_*.pyx` modules beside this file) is required: there is no silent pure-Python
fallback. A core built from other sources than the ones beside it is refused too.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

_HERE = Path(__file__).parent


def _source_hash(folder: Path) -> str | None:
    sources = sorted(folder.glob("*.p[yx][xd]"))
    if not sources:
        return None  # an installed wheel without sources: nothing to compare against
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# Every planner_cy/_*.pyx is one compiled module (see setup.py); tests/planner pins the list.
COMPILED_MODULES = tuple(sorted(path.stem for path in _HERE.glob("_*.pyx")))


def _load_compiled() -> None:
    expected = _source_hash(_HERE)
    for name in COMPILED_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ImportError as error:
            raise ImportError(
                f"the compiled planner ({__name__}.{name}) is missing: build it with `make build`; cause: {error}"
            ) from error
        if expected is not None and expected != module.SOURCE_HASH:
            raise ImportError(
                f"the compiled planner ({__name__}.{name}) is stale: its Cython sources changed since it "
                "was built; rebuild it with `make build`"
            )


_load_compiled()

# Instantiation, batch distribution and reconfiguration (after the compiled-module check on purpose).
from .instantiate import instantiate, plan_job  # noqa: E402
from .reconfigure import LostLayersError, reconfigure  # noqa: E402

__all__ = ["COMPILED_MODULES", "LostLayersError", "instantiate", "plan_job", "reconfigure"]
