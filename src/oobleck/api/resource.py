"""The OobleckJob resource's names: its API group, version and kind, and the labels its pods carry."""

from __future__ import annotations

GROUP = "oobleck.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "OobleckJob"
PLURAL = "oobleckjobs"
SINGULAR = "oobleckjob"
SHORT_NAMES = ("oj",)

# Child objects are named `<job>-<suffix>` (pods `<job>-worker-<n>`, a Service, a ConfigMap) and
# Services need DNS-1035 labels of at most 63 characters: 40 leaves room for the suffixes.
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Labels and environment variables the operator and runtime set themselves; overrides may not.
RESERVED_LABEL_PREFIX = f"{GROUP}/"
RESERVED_ENV_PREFIX = "OOBLECK_"
# The label on every worker pod naming its job; status.selector (the scale subresource's label
# selector) is `worker_selector(job_name)`.
JOB_LABEL = f"{GROUP}/job"
# Every pod of a job also carries its role: `worker` (one per node) or `coordinator`.
ROLE_LABEL = f"{GROUP}/role"
WORKER_ROLE = "worker"
COORDINATOR_ROLE = "coordinator"


def worker_selector(job_name: str) -> str:
    """The label selector of a job's worker pods (not its coordinator), as status.selector holds it."""
    return f"{JOB_LABEL}={job_name},{ROLE_LABEL}={WORKER_ROLE}"
