"""Test processes forked from an interpreter that imported torch and the runtime once.

The product's forkserver (oobleck.runtime.backends.local.forkserver, what `oobleck launch` starts its workers
with) preloaded with everything a test's worker may import: the CLI, the pod backend, transformers. Tests
start `python -m oobleck.runtime worker` processes and their own driver scripts this way: a fresh interpreter
spends ~2 s of CPU importing torch (~4.5 s with a transformers model), a third of a short multi-rank test on the
shared 2-core CI host. One server per test process (multiprocessing's forkserver is one per process: the
first preload wins, and a test process starts this one first).
"""

from __future__ import annotations

from pathlib import Path

from oobleck.runtime.backends.local.forkserver import TRANSFORMERS_PRELOAD, WORKER_PRELOAD, ForkedProcess

RUNTIME_PRELOAD = (
    *WORKER_PRELOAD,
    "oobleck.runtime.cli",
    "oobleck.runtime.models.hf",
    *TRANSFORMERS_PRELOAD,
)
"""What a test's worker process imports (oobleck_dev.podzygote preloads these too)."""


def start(
    command: list[str], stdout: Path, env: dict[str, str], stderr: Path | None = None, new_session: bool = False
) -> ForkedProcess:
    """`python *command` (`["-m", "oobleck.runtime", "worker", ...]` or `[script, *args]`) with `env` as
    its whole environment, its output written to `stdout` (and `stderr`, else `stdout` too), both emptied
    first as a shell's redirection would; `new_session`: in a session and process group of its own, as
    Popen's `start_new_session`."""
    for path in (stdout, stderr):
        if path is not None:
            Path(path).write_bytes(b"")
    return ForkedProcess(command, stdout, env, stderr, new_session=new_session, preload=RUNTIME_PRELOAD)
