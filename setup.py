"""Builds the compiled planner core; everything else is declared in pyproject.toml.

The compiled module embeds a hash of its Cython sources so that `oobleck.planner` can refuse to
import a stale build (see planner_cy/__init__.py).
"""

from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
PLANNER = HERE / "planner_cy"


def planner_source_hash() -> str:
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(PLANNER.glob("*.p[yx][xd]")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# Written only when it changes: a rewrite makes every compiled module stale, and the build recompiles them all.
SOURCE_HASH_FILE = PLANNER / "_source_hash.pxi"
SOURCE_HASH_LINE = f'SOURCE_HASH = "{planner_source_hash()}"\n'
if not SOURCE_HASH_FILE.exists() or SOURCE_HASH_FILE.read_text() != SOURCE_HASH_LINE:
    SOURCE_HASH_FILE.write_text(SOURCE_HASH_LINE)


def pxd_include_dir() -> str:
    """Cython looks up a module's .pxd by its full name (oobleck/planner/_x.pxd); the sources live in
    planner_cy/, so mirror the .pxd files under the package path in the build folder."""
    mirror = HERE / "build" / "cython-include"
    package = mirror / "oobleck" / "planner"
    package.mkdir(parents=True, exist_ok=True)
    for stale in package.glob("_*.pxd"):
        stale.unlink()
    for pxd in PLANNER.glob("_*.pxd"):
        (package / pxd.name).symlink_to(pxd.resolve())
    return str(mirror)


# One extension per planner_cy/_*.pyx, importable as oobleck.planner._<name>.
extensions = [
    Extension(f"oobleck.planner.{source.stem}", [f"planner_cy/{source.name}"], extra_compile_args=["-O3"])
    for source in sorted(PLANNER.glob("_*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        include_path=[pxd_include_dir()],
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "nonecheck": False,
            "embedsignature": True,
        },
    )
)
