"""Locate the Kubernetes binaries the local control plane runs.

Each tool is looked up, in order, in `$KUBEBUILDER_ASSETS`, then in the k8s-tools cache built by
`scripts/k8s-tools/build` (pinned versions, built from Go modules), then on `PATH` — the last
only when `OOBLECK_K8S_TOOLS_FROM_PATH=1`, because a `kubectl` on PATH is often something else
(a cloud SDK's dispatcher, another cluster's version).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The control plane cannot start without these.
REQUIRED = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
# Only some features need these (fake nodes, chart tests).
OPTIONAL = ("kwok", "helm")

BUILD_SCRIPT = Path("scripts") / "k8s-tools" / "build"
# How long `scripts/k8s-tools/build` may take when asked to build (cold Go build on 2 cores).
BUILD_TIMEOUT_S = 3 * 3600


class ToolsNotFound(RuntimeError):
    """A required Kubernetes binary is missing; the message says where it was looked for."""


@dataclass(frozen=True)
class K8sTools:
    """Absolute paths of the Kubernetes binaries, and where each came from."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path | None
    helm: Path | None
    kwok_stages: Path | None
    """kwok's stage YAMLs (`node/fast`, `pod/fast`, ...), shipped beside the cache's bin folder."""
    sources: dict[str, str]
    """tool name -> "KUBEBUILDER_ASSETS" | "cache" | "PATH"."""

    def require_kwok(self) -> tuple[Path, Path]:
        """The kwok binary and its stage folder, or a clear error."""
        if self.kwok is None or self.kwok_stages is None:
            raise ToolsNotFound(
                "kwok (binary and kwok-stages/) not found: run scripts/k8s-tools/build, "
                "or put kwok in $KUBEBUILDER_ASSETS next to a kwok-stages/ folder"
            )
        return self.kwok, self.kwok_stages


def repo_root() -> Path | None:
    """The source checkout this package is installed from (editable install), if any."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / BUILD_SCRIPT).is_file():
            return parent
    return None


def cache_root() -> Path:
    """The project's cache folder, where scripts/ keep their builds too: $OOBLECK_CACHE, else ~/.cache/oobleck."""
    return Path(os.environ.get("OOBLECK_CACHE") or Path.home() / ".cache" / "oobleck")


def cache_bin_dir(build: bool = False) -> Path | None:
    """The k8s-tools cache's bin folder; with `build`, build it first if incomplete.

    Without `build` this returns None when the cache is incomplete (the script exits 1).
    """
    root = repo_root()
    if root is None:
        return None
    script = root / BUILD_SCRIPT
    args = [str(script)] if build else [str(script), "--print"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S if build else 60, cwd=root)
    if result.returncode != 0:
        if build:
            raise ToolsNotFound(f"{script} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
        return None
    return Path(result.stdout.strip().splitlines()[-1])


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_tools(build: bool = False, env: dict[str, str] | None = None) -> K8sTools:
    """Find every tool (see the module docstring for the order).

    `build`: run `scripts/k8s-tools/build` when a required tool is found nowhere else.
    `env`: the environment to read (default `os.environ`), for tests.
    """
    env = dict(os.environ) if env is None else env
    assets = env.get("KUBEBUILDER_ASSETS", "")
    from_path = env.get("OOBLECK_K8S_TOOLS_FROM_PATH", "") == "1"
    searched: list[str] = []
    if assets:
        searched.append(f"$KUBEBUILDER_ASSETS={assets}")

    found: dict[str, Path] = {}
    sources: dict[str, str] = {}

    def look(where: Path | None, label: str) -> None:
        if where is None:
            return
        for name in REQUIRED + OPTIONAL:
            if name not in found and _executable(where / name):
                found[name], sources[name] = (where / name).absolute(), label

    if assets:
        look(Path(assets), "KUBEBUILDER_ASSETS")
    cache = cache_bin_dir(build=False)
    if cache is None and build and any(name not in found for name in REQUIRED):
        cache = cache_bin_dir(build=True)
    searched.append(f"k8s-tools cache ({cache})" if cache else "k8s-tools cache (not built: scripts/k8s-tools/build)")
    look(cache, "cache")
    if from_path:
        searched.append("PATH")
        for name in REQUIRED + OPTIONAL:
            hit = shutil.which(name, path=env.get("PATH"))
            if name not in found and hit:
                found[name], sources[name] = Path(hit).absolute(), "PATH"
    else:
        searched.append("not PATH (set OOBLECK_K8S_TOOLS_FROM_PATH=1 to allow it)")

    missing = [name for name in REQUIRED if name not in found]
    if missing:
        raise ToolsNotFound(f"missing {', '.join(missing)}; searched: {'; '.join(searched)}")

    stages: Path | None = None
    if "kwok" in found:
        # Stages ship beside the cache's bin/ (or beside a kwok binary in KUBEBUILDER_ASSETS).
        for candidate in (found["kwok"].parent.parent / "kwok-stages", found["kwok"].parent / "kwok-stages"):
            if candidate.is_dir():
                stages = candidate
                break
        if stages is None and cache is not None and (cache.parent / "kwok-stages").is_dir():
            stages = cache.parent / "kwok-stages"

    return K8sTools(
        etcd=found["etcd"],
        kube_apiserver=found["kube-apiserver"],
        kube_controller_manager=found["kube-controller-manager"],
        kube_scheduler=found["kube-scheduler"],
        kubectl=found["kubectl"],
        kwok=found.get("kwok"),
        helm=found.get("helm"),
        kwok_stages=stages,
        sources=sources,
    )
