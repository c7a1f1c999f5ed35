"""The Dockerfile, read: it copies what pyproject builds from, calls only entry points that exist,
agrees with the Helm chart, keeps the hadolint-style basics, and orders the runtime's layers so a
source edit remakes only the top ones. tests/image builds it (buildah) and runs the image.

The image runs three commands (the chart's Deployment, the operator's worker pods and coordinator
pods); each is run here with `--help` from this checkout's installed environment, which is built
from the same pyproject.toml the image installs.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)


REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CHART_VALUES = yaml.safe_load((REPO / "charts" / "oobleck-operator" / "values.yaml").read_text())
GOLDEN = REPO / "tests" / "helm" / "golden" / "default.yaml"
BIN = Path(sys.executable).parent  # the environment the tests run in (.venv/bin)


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    image: str  # as written (may contain ${ARG})
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def expand(self, text: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.global_args.get(m.group(1), m.group(0)), text)


def parse(text: str) -> Dockerfile:
    """Instructions with continuation lines joined and comments dropped (Docker's own rules)."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments, also between continuation lines, and blank lines
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        line = pending + stripped
        pending = ""
        keyword, _, args = line.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
    assert not pending, "the Dockerfile ends inside a continuation line"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            parts = instruction.args.split()
            parts = [p for p in parts if not p.startswith("--platform")]
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif not stages:
            assert instruction.keyword == "ARG", f"line {instruction.line}: only ARG may precede the first FROM"
            key, _, default = instruction.args.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append(instruction)
    return Dockerfile(global_args, stages)


def copy_parts(instruction: Instruction) -> tuple[dict[str, str], list[str], str]:
    """(flags, sources, destination) of a COPY/ADD, shell or JSON form."""
    words = shlex.split(instruction.args)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    rest = " ".join(words)
    if rest.startswith("["):
        words = json.loads(rest)
    return flags, words[:-1], words[-1]


DF = parse(DOCKERFILE.read_text())
FINAL = DF.stages[-1]
STAGE_NAMES = {s.name for s in DF.stages if s.name}


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def ignored(path: str) -> bool:
    """Whether .dockerignore drops `path` (relative) or one of its parents: Go filepath.Match, plus `**`."""
    parts = Path(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in dockerignore_patterns():
        assert not pattern.startswith("!"), "exceptions are not handled by this check"
        pattern = pattern.strip("/")
        for candidate in candidates:
            if fnmatch.fnmatchcase(candidate, pattern):
                return True
            if pattern.startswith("**/") and any(
                fnmatch.fnmatchcase("/".join(candidates[-1].split("/")[i:]), pattern[3:]) for i in range(len(parts))
            ):
                return True
    return False


def context_copies() -> list[tuple[str, Instruction]]:
    """Every (source, instruction) copied from the build context (not from another stage)."""
    out = []
    for stage in DF.stages:
        for instruction in stage.all("COPY") + stage.all("ADD"):
            flags, sources, _ = copy_parts(instruction)
            if "from" not in flags:
                out += [(source, instruction) for source in sources]
    return out


# -- the build context ------------------------------------------------------------------------------


def test_every_copied_source_exists_and_is_not_ignored() -> None:
    copies = context_copies()
    assert copies
    for source, instruction in copies:
        matches = list(REPO.glob(source.rstrip("/")))
        assert matches, f"Dockerfile line {instruction.line}: COPY {source}: no such file in the repository"
        assert not ignored(source.rstrip("/")), (
            f"Dockerfile line {instruction.line}: {source} is excluded by .dockerignore"
        )


def test_what_pyproject_builds_from_is_copied() -> None:
    copied = {source.rstrip("/") for source, _ in context_copies()}
    needed = {
        "pyproject.toml",
        "setup.py",
        PYPROJECT["project"]["readme"],
        *PYPROJECT["tool"]["setuptools"]["package-dir"].values(),
    }
    needed.discard("")
    assert needed <= copied, f"not copied into the image: {sorted(needed - copied)}"
    # Every source file of those packages survives .dockerignore (e.g. the planner's .pyx/.pxd).
    for folder in PYPROJECT["tool"]["setuptools"]["package-dir"].values():
        for path in (REPO / folder).rglob("*"):
            if path.suffix in {".py", ".pyx", ".pxd", ".pyi"} and "__pycache__" not in path.parts:
                relative = path.relative_to(REPO).as_posix()
                assert not ignored(relative), f"{relative} is a package source but .dockerignore drops it"


def test_build_outputs_are_not_sent_into_the_build() -> None:
    for artifact in (
        "planner_cy/_templates.c",
        "planner_cy/_source_hash.pxi",
        "planner_cy/_x.cpython-311-x86_64-linux-gnu.so",
        ".venv",
        "build",
        ".git",
        "runtime/__pycache__/x.pyc",
    ):
        assert ignored(artifact), f".dockerignore should drop {artifact}"


# -- stages -------------------------------------------------------------------------------------------


def test_base_images_are_pinned_and_python_is_new_enough() -> None:
    for stage in DF.stages:
        if stage.image in STAGE_NAMES:
            continue
        image = DF.expand(stage.image)
        assert "$" not in image, f"FROM {stage.image}: an ARG without a default"
        name, _, tag = image.partition("@")[0].rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
        assert tag and tag != "latest", f"FROM {image}: pin a tag (not latest)"
    default_base = DF.global_args["BASE_IMAGE"]
    assert default_base.startswith("python:"), default_base
    version = tuple(int(x) for x in re.match(r"python:(\d+)\.(\d+)", default_base).groups())
    required = tuple(int(x) for x in re.match(r">=\s*(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"]).groups())
    assert version >= required, (
        f"{default_base} is older than requires-python {PYPROJECT['project']['requires-python']}"
    )


def test_multi_stage_build_compiles_and_the_runtime_gets_only_the_wheel() -> None:
    names = [s.name for s in DF.stages]
    assert names == ["base", "requirements", "build", "runtime"], names
    requirements, build, runtime = DF.stages[1:]
    # Same interpreter everywhere: the wheel's compiled planner is built for the runtime's Python.
    assert {requirements.image, build.image, runtime.image} == {"base"}
    build_runs = " ".join(i.args for i in build.all("RUN"))
    assert "gcc" in build_runs and "pip wheel" in build_runs
    runtime_runs = " ".join(i.args for i in runtime.all("RUN"))
    assert not re.search(r"\b(gcc|g\+\+|build-essential|python3-dev)\b", runtime_runs), (
        "no compiler in the runtime stage"
    )
    assert "import oobleck.planner" in runtime_runs, "the runtime stage proves the compiled planner loads"
    # The runtime gets the project only as the built wheel; no source from the build context.
    copies = [copy_parts(i) for i in runtime.all("COPY")]
    assert all(flags.get("from") in ("requirements", "build") for flags, _, _ in copies), copies
    assert [sources for flags, sources, _ in copies if flags.get("from") == "build"] == [["/wheels/"]]
    torch_arg = [i for i in runtime.all("ARG") if i.args.startswith("TORCH_INDEX_URL=")]
    assert torch_arg and torch_arg[0].args == "TORCH_INDEX_URL=", "TORCH_INDEX_URL defaults to pip's configured index"
    assert '--index-url "${TORCH_INDEX_URL}"' in runtime_runs


def test_runtime_layers_go_from_torch_to_the_wheel() -> None:
    """A source edit changes only the wheel: every layer before it (torch, then the other
    dependencies) must not depend on the sources, so a rebuild reuses them (gigabytes) and makes
    only the small top layers."""
    runtime = DF.stages[-1]
    steps = runtime.instructions

    def index(keyword: str, text: str) -> int:
        found = [n for n, i in enumerate(steps) if i.keyword == keyword and text in i.args]
        assert len(found) == 1, f"one {keyword} with {text!r} expected in the runtime stage, found {len(found)}"
        return found[0]

    torch = index("RUN", "/requirements/torch.txt")
    dependencies = index("RUN", "/requirements/dependencies.txt")
    wheel_copy = index("COPY", "/wheels/")
    wheel_install = index("RUN", "/wheels/*.whl")
    assert torch < dependencies < wheel_copy < wheel_install
    # The requirement files come from a stage that reads only pyproject.toml: they change with the
    # requirements, not with the sources or the rest of pyproject.toml.
    requirements = DF.stages[1]
    assert [sources for _, sources, _ in map(copy_parts, requirements.all("COPY"))] == [["pyproject.toml"]]
    for n in (torch, dependencies):
        assert steps[n - 1].keyword == "COPY" and copy_parts(steps[n - 1])[0].get("from") == "requirements"
    # The wheel is installed as it is: no dependency resolution, nothing downloaded on a source edit.
    assert "--no-deps" in steps[wheel_install].args and "--no-index" in steps[wheel_install].args
    # Build arguments and labels that change more often than the dependencies come after them
    # (a changed ARG value invalidates the cache of every RUN after it).
    for instruction in steps[:wheel_install]:
        if instruction.keyword in ("ARG", "LABEL"):
            assert instruction.args.startswith("TORCH_INDEX_URL="), (
                f"line {instruction.line}: {instruction.keyword} {instruction.args} before the dependency layers"
            )
    # The build stage installs its build backend before copying the sources (a source edit
    # rebuilds the wheel without downloading setuptools and Cython again).
    build = DF.stages[2]
    build_steps = build.instructions
    backend = next(n for n, i in enumerate(build_steps) if "build-system.txt" in i.args and i.keyword == "RUN")
    first_source = next(n for n, i in enumerate(build_steps) if i.keyword == "COPY" and "from" not in copy_parts(i)[0])
    assert backend < first_source
    assert "--no-build-isolation" in " ".join(i.args for i in build.all("RUN"))
    # The compiled planner is built from planner_cy/ and the build files alone, before the other sources come
    # in: an edit elsewhere reuses its layer, and the wheel's build finds it up to date.
    compile_step = next(n for n, i in enumerate(build_steps) if i.keyword == "RUN" and "build_ext" in i.args)
    copied_before = [
        source
        for i in build_steps[:compile_step]
        if i.keyword == "COPY" and "from" not in copy_parts(i)[0]
        for source in copy_parts(i)[1]
    ]
    assert sorted(copied_before) == ["planner_cy/", "pyproject.toml", "setup.py"], copied_before


def test_hadolint_basics() -> None:
    # No ADD (COPY is explicit; ADD of a URL fetches unpinned content).
    for stage in DF.stages:
        for instruction in stage.all("ADD"):
            _, sources, _ = copy_parts(instruction)
            assert not any(re.match(r"\w+://", s) for s in sources), f"line {instruction.line}: ADD of a URL"
            pytest.fail(f"line {instruction.line}: use COPY instead of ADD")
        for instruction in stage.all("RUN"):
            if "apt-get install" in instruction.args:
                assert "--no-install-recommends" in instruction.args, (
                    f"line {instruction.line}: apt-get install --no-install-recommends"
                )
                assert "rm -rf /var/lib/apt/lists/*" in instruction.args, (
                    f"line {instruction.line}: clean the apt lists"
                )
            assert not re.search(r"\bsudo\b|\bcurl\b.*\|\s*(ba)?sh", instruction.args), f"line {instruction.line}"
            assert not re.search(r"(^|\s)cd\s", instruction.args), f"line {instruction.line}: use WORKDIR, not cd"
    users = FINAL.all("USER")
    assert users, "the runtime stage sets no USER (it would run as root)"
    uid, _, gid = users[-1].args.partition(":")
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root uid (runAsNonRoot can verify only numbers)"
    assert FINAL.all("ENTRYPOINT") and FINAL.all("ENTRYPOINT")[-1].args.startswith("["), (
        "exec-form ENTRYPOINT (signals reach the process)"
    )


# -- agreement with the chart and the operator --------------------------------------------------------


def test_user_and_ports_match_the_chart() -> None:
    uid, _, gid = FINAL.all("USER")[-1].args.partition(":")
    pod = CHART_VALUES["podSecurityContext"]
    assert (int(uid), int(gid)) == (pod["runAsUser"], pod["runAsGroup"])
    from oobleck.api.contract import STORE_PORT, WORKER_PORT
    from oobleck.operator.render import IMAGE_UID

    assert int(uid) == int(gid) == IMAGE_UID  # worker pods run as the image's user (operator/render.py)
    exposed = {int(p.split("/")[0]) for i in FINAL.all("EXPOSE") for p in i.args.split()}
    assert {CHART_VALUES["metrics"]["port"], CHART_VALUES["liveness"]["port"], STORE_PORT, WORKER_PORT} <= exposed


def image_commands() -> dict[str, list[str]]:
    """Every command a container of this image is started with, by who starts it."""
    entrypoint = json.loads(FINAL.all("ENTRYPOINT")[-1].args)
    cmd = json.loads(FINAL.all("CMD")[-1].args) if FINAL.all("CMD") else []
    docs = [d for d in yaml.safe_load_all(GOLDEN.read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    from oobleck.api.spec import parse_spec
    from oobleck.operator import render
    from oobleck.operator.settings import DEFAULT_COMMAND

    spec = parse_spec(yaml.safe_load((REPO / "examples" / "tiny-gpt.yaml").read_text())["spec"])
    coordinator = render.coordinator_pod("tiny-gpt", "ns", "uid", spec, default_image="image")["spec"]["containers"][0]
    worker = render.worker_pod(
        "tiny-gpt", "ns", "uid", spec, 0, default_image="image", default_command=list(DEFAULT_COMMAND)
    )
    return {
        "image ENTRYPOINT + CMD": entrypoint + cmd,
        "chart Deployment": container["command"] + container["args"],
        "operator's worker pods": worker["spec"]["containers"][0]["command"],
        "operator's coordinator pod": coordinator["command"],
    }


def test_entrypoint_is_the_installed_console_script() -> None:
    entrypoint = json.loads(FINAL.all("ENTRYPOINT")[-1].args)
    assert entrypoint == ["oobleck"]
    assert "oobleck" in PYPROJECT["project"]["scripts"], "pyproject [project.scripts] must define oobleck"
    assert (BIN / "oobleck").is_file(), f"{BIN / 'oobleck'}: the console script is not installed (run scripts/venv)"


@pytest.mark.parametrize(
    "who", ["image ENTRYPOINT + CMD", "chart Deployment", "operator's worker pods", "operator's coordinator pod"]
)
def test_every_command_the_image_runs_exists(who: str) -> None:
    command = image_commands()[who]
    program = command[0]
    assert program in ("oobleck", "python"), f"{who} runs {program!r}, which the image does not provide"
    if program == "oobleck":
        # The subcommand (if any) with --help: argparse exits 0 only for a known subcommand.
        sub = [arg for arg in command[1:2] if not arg.startswith("-")]
        argv = [str(BIN / "oobleck"), *sub, "--help"]
    else:
        assert command[1] == "-m", f"{who}: {command}"
        argv = [sys.executable, "-m", command[2], "--help"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO / "tests")
    assert result.returncode == 0, f"{who}: `{' '.join(argv)}` failed:\n{result.stderr[-2000:]}"
