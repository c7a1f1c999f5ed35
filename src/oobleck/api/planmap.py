"""The plan ConfigMap `<job>-plan` and the pod annotations: the operator <-> worker contract's encoding.

Both sides import this module (the operator writes, the runtime in a worker pod reads), so that the
runtime never imports the operator. The contract itself (env, ports, exit codes, annotations) is
oobleck.api.contract; the children's roles are in the docstring of oobleck.operator.render. Pure functions of plain dicts (Kubernetes objects as JSON), no I/O.

Keys of the ConfigMap:
    plan.json       the Plan as JSON, or "" when it is gzipped into binaryData
    plan.json.gz    (binaryData, base64) gzip of the same JSON, for plans over the inline limit
    profile.json    the ModelProfile planned with
    job.json        the job's spec (camelCase)
Annotation GENERATION_ANNOTATION on the ConfigMap equals the plan's generation.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import zlib
from typing import Any

from oobleck.api.contract import FAILURES_SURVIVED_ANNOTATION, GENERATION_ANNOTATION
from oobleck.api.plan import Plan
from oobleck.api.profile import ModelProfile

PLAN_KEY = "plan.json"
PLAN_GZ_KEY = "plan.json.gz"
PROFILE_KEY = "profile.json"
JOB_KEY = "job.json"
# Plans above this are gzipped: every worker pod's watch receives the whole ConfigMap at each
# generation, and a 1024-node x 8-GPU plan is 481 kB as JSON but 53 kB gzipped (a ConfigMap holds
# at most 1 MiB). Small plans stay readable with kubectl.
PLAN_INLINE_LIMIT = 64 * 1024
# The most a gzipped plan may decompress to. A 4096-node x 16-GPU plan is about 4 MB of JSON; a
# ConfigMap of 1 MiB of gzipped zeros would otherwise become gigabytes in every reader's memory.
MAX_PLAN_BYTES = 32 << 20


def encode_plan(plan: Plan, inline_limit: int = PLAN_INLINE_LIMIT) -> tuple[dict[str, str], dict[str, str]]:
    """(data, binaryData) entries holding `plan`: inline JSON, or gzipped when longer than `inline_limit`."""
    text = plan.to_json()
    if len(text) > inline_limit:
        # mtime=0: the same plan always gives the same bytes.
        return {PLAN_KEY: ""}, {PLAN_GZ_KEY: base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode()}
    return {PLAN_KEY: text}, {}


def _name(config_map: dict[str, Any]) -> str:
    return (config_map.get("metadata") or {}).get("name", "?")


def gunzip_capped(data: bytes, cap: int) -> bytes:
    """`data` gunzipped, never holding more than `cap` bytes of output: ValueError past it."""
    stream = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out = stream.decompress(data, cap)
    if stream.unconsumed_tail or (not stream.eof and len(out) >= cap):
        raise ValueError(f"decompresses to more than the cap of {cap} bytes ({cap >> 20} MiB)")
    if not stream.eof:
        raise ValueError("truncated gzip data")
    return out


def read_plan(config_map: dict[str, Any], max_bytes: int = MAX_PLAN_BYTES) -> Plan:
    """The Plan in a plan ConfigMap (either form); raises ValueError naming the key if it is invalid or
    its gzipped form decompresses to more than `max_bytes`."""
    binary = (config_map.get("binaryData") or {}).get(PLAN_GZ_KEY)
    key = PLAN_GZ_KEY if binary else PLAN_KEY
    try:
        if binary:
            text = gunzip_capped(base64.b64decode(binary), max_bytes).decode()
        else:
            text = (config_map.get("data") or {}).get(PLAN_KEY) or ""
        return Plan.model_validate_json(text)
    except (ValueError, OSError, zlib.error, binascii.Error) as error:
        raise ValueError(f"configmap {_name(config_map)}: key {key}: not a valid plan: {error}") from error


def read_generation(config_map: dict[str, Any]) -> int | None:
    """The generation annotation of a plan ConfigMap (cheap: no plan decoding), or None."""
    value = ((config_map.get("metadata") or {}).get("annotations") or {}).get(GENERATION_ANNOTATION, "")
    return int(value) if value.isdigit() else None


def read_profile(config_map: dict[str, Any]) -> ModelProfile | None:
    """The profile stored beside the plan, or None when the ConfigMap has none."""
    text = (config_map.get("data") or {}).get(PROFILE_KEY)
    return ModelProfile.model_validate_json(text) if text else None


def read_job_spec(config_map: dict[str, Any]) -> dict[str, Any]:
    """The job's spec (camelCase dict) stored beside the plan; ValueError naming the key if absent or invalid."""
    text = (config_map.get("data") or {}).get(JOB_KEY)
    if not text:
        raise ValueError(f"configmap {_name(config_map)}: key {JOB_KEY}: missing")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"configmap {_name(config_map)}: key {JOB_KEY}: not JSON: {error}") from error
    if not isinstance(spec, dict):
        raise ValueError(f"configmap {_name(config_map)}: key {JOB_KEY}: expected an object, got {type(spec).__name__}")
    return spec


def read_failures_survived(config_map: dict[str, Any]) -> int:
    value = ((config_map.get("metadata") or {}).get("annotations") or {}).get(FAILURES_SURVIVED_ANNOTATION, "0")
    return int(value) if value.isdigit() else 0
