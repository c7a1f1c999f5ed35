"""`oobleck operator` that crashes right after its first plan write that moves a plan on (a generation after
the first): fault injection for the restart tests.

Run as a script (`python tests/e2e/crash_after_plan_write.py operator ARGS...`, see
OperatorProcess.start's `program`): it wraps the operator's one plan-write call (Api.write_plan) so
that the process exits with 137 (os._exit: as abrupt as SIGKILL) as soon as the write has landed,
before any pod patch, delete or create of that decision; then runs the ordinary `oobleck` entry point.
Creating generation 0 passes through, so a test may start this operator before its job. The operator
itself carries no test hook.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from oobleck.cli import main
from oobleck.operator.apply import Api

log = logging.getLogger("oobleck.tests.crash")
_write_plan = Api.write_plan


async def _write_plan_then_crash(self: Api, body: dict[str, Any], owner_uid: str, resource_version: str | None) -> str:
    written = await _write_plan(self, body, owner_uid, resource_version)
    if resource_version is None:  # generation 0 created: the crash is for a later generation
        return written
    log.warning("crash-after-plan-write: exiting between the plan write and the pod patches")
    os._exit(137)
    return written  # not reached


Api.write_plan = _write_plan_then_crash  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
