"""Manifests of an OobleckJob's children, as plain dicts: pure functions of the spec and the plan.

Children (all named deterministically and owned by the job through a controller ownerReference, so
that deleting the job garbage-collects them and a retried create answers 409 instead of duplicating):

    <job>-worker-<i>     a worker Pod per node (index i never changes for the pod's life)
    <job>-coordinator    the Pod hosting the rendezvous store (outlives any worker)
    <job>-workers        a headless Service: stable DNS names for the pods above
    <job>-plan           the ConfigMap holding the versioned plan (the source of truth)
    <job>-worker         the ServiceAccount, Role and RoleBinding of the workers

The contract with the runtime (what a worker pod may rely on):

- Environment of the worker container:
  OOBLECK_JOB (job name), OOBLECK_NAMESPACE, OOBLECK_NODE (this pod's name: the plan's node id),
  OOBLECK_PLAN_CONFIGMAP (`<job>-plan`), OOBLECK_STORE (`<job>-coordinator.<job>-workers.<ns>.svc:29400`,
  the coordinator's TCPStore), OOBLECK_GPUS_PER_NODE, OOBLECK_DEVICE (cuda or cpu).
- The plan ConfigMap: `plan.json` (oobleck.api.plan.Plan as JSON) or, when that would exceed
  PLAN_INLINE_LIMIT bytes, `plan.json.gz` in binaryData (gzip of the same JSON); `profile.json` (the
  ModelProfile planned with) and `job.json` (the job's spec, camelCase). The annotation
  GENERATION_ANNOTATION equals the plan's generation. `read_plan` decodes either form. The operator
  replaces the plan as a whole and only ever increases its generation.
- Annotations on worker pods, written by the operator: GENERATION_ANNOTATION (the newest generation
  this pod has been told about; it is patched *after* the ConfigMap holds that generation) and
  RANKS_ANNOTATION (comma-separated ranks of local GPUs 0..G-1 in that generation; empty: not in it).
- Annotations on worker pods, written by the worker about itself (RBAC allows it to patch pods):
  FAILURE_ANNOTATION: a oobleck.runtime.health.FailureReport as JSON (`job`, `generation`,
  `reporter`, `kind`, `dead` (plan node ids), `detail`); kind "gpu" with `dead` empty or naming the
  reporter marks the reporter's own GPU unhealthy. Reports for another generation than the current
  plan's are ignored. PROGRESS_ANNOTATION: `{"generation": g, "step": s}` after each optimizer
  step (or less often); a step >= spec.training.steps completes the job.
"""

from __future__ import annotations

import base64
import gzip
import json
from typing import Any

from oobleck.api.job import (
    API_VERSION,
    COORDINATOR_ROLE,
    GROUP,
    JOB_LABEL,
    KIND,
    ROLE_LABEL,
    WORKER_ROLE,
    OobleckJobSpec,
)
from oobleck.api.plan import Plan
from oobleck.api.profile import ModelProfile

INDEX_LABEL = f"{GROUP}/worker-index"

GENERATION_ANNOTATION = f"{GROUP}/plan-generation"
RANKS_ANNOTATION = f"{GROUP}/ranks"
FAILURE_ANNOTATION = f"{GROUP}/failure-report"
PROGRESS_ANNOTATION = f"{GROUP}/progress"
FAILURES_SURVIVED_ANNOTATION = f"{GROUP}/failures-survived"

STORE_PORT = 29400
WORKER_PORT = 29500
PLAN_KEY = "plan.json"
PLAN_GZ_KEY = "plan.json.gz"
PROFILE_KEY = "profile.json"
JOB_KEY = "job.json"
# A ConfigMap holds at most 1 MiB; a 1000-node, 8-GPU plan is close, so big plans are gzipped.
PLAN_INLINE_LIMIT = 512 * 1024

# Pod names are `<job>-worker-<index>`: the job name is at most 40 characters (api.job), which
# leaves room for any index below a million within the 63-character hostname limit.


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def coordinator_name(job: str) -> str:
    return f"{job}-coordinator"


def service_name(job: str) -> str:
    return f"{job}-workers"


def plan_name(job: str) -> str:
    return f"{job}-plan"


def rbac_name(job: str) -> str:
    return f"{job}-worker"


def worker_index(job: str, pod_name: str) -> int | None:
    """The index in `<job>-worker-<index>`, or None if the name is not a worker's of this job."""
    prefix = f"{job}-worker-"
    tail = pod_name[len(prefix):] if pod_name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and str(int(tail)) == tail else None


def store_address(job: str, namespace: str) -> str:
    return f"{coordinator_name(job)}.{service_name(job)}.{namespace}.svc:{STORE_PORT}"


def owner_reference(job: str, uid: str) -> dict[str, Any]:
    """The controller ownerReference every child carries (garbage collection on job deletion)."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job, "uid": uid, "controller": True, "blockOwnerDeletion": True}


def _meta(name: str, namespace: str, job: str, uid: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": {JOB_LABEL: job, **(labels or {})},
        "ownerReferences": [owner_reference(job, uid)],
    }


def ranks_table(plan: Plan) -> dict[str, str]:
    """RANKS_ANNOTATION for every node of the plan: its ranks for local GPUs 0..G-1 (one pass over the ranks)."""
    by_node: dict[str, dict[int, int]] = {}
    for a in plan.ranks:
        by_node.setdefault(a.node, {})[a.gpu] = a.rank
    return {
        node: ",".join(str(ranks.get(gpu, "")) for gpu in range(plan.gpus_per_node)) for node, ranks in by_node.items()
    }


def ranks_value(plan: Plan | None, node: str, gpus_per_node: int) -> str:
    """RANKS_ANNOTATION for `node` alone, or "" when it is not in the plan."""
    if plan is None:
        return ""
    ranks = {a.gpu: a.rank for a in plan.ranks if a.node == node}
    if not ranks:
        return ""
    return ",".join(str(ranks.get(gpu, "")) for gpu in range(gpus_per_node))


def worker_annotations(plan: Plan, node: str, table: dict[str, str] | None = None) -> dict[str, str]:
    """The annotations that tell a worker pod about `plan` (the patch sent after the plan is written).
    Pass `ranks_table(plan)` when annotating many pods."""
    ranks = table.get(node, "") if table is not None else ranks_value(plan, node, plan.gpus_per_node)
    return {GENERATION_ANNOTATION: str(plan.generation), RANKS_ANNOTATION: ranks}


def _security() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod, container


def worker_pod(
    job: str, namespace: str, uid: str, spec: OobleckJobSpec, index: int, *, default_image: str, default_command: list[str]
) -> dict[str, Any]:
    """The worker Pod `<job>-worker-<index>`: one per node, `gpusPerNode` GPUs, never restarted in place
    (a dead worker is a lost node: the operator re-plans without it and creates a replacement)."""
    name = worker_name(job, index)
    requests: dict[str, Any] = {"cpu": str(spec.resources.cpu), "memory": str(spec.resources.memory)}
    limits: dict[str, Any] = {"memory": str(spec.resources.memory)}
    if spec.device == "cuda":
        requests[spec.gpu_resource_name] = str(spec.gpus_per_node)
        limits[spec.gpu_resource_name] = str(spec.gpus_per_node)
    env = [
        {"name": "OOBLECK_JOB", "value": job},
        {"name": "OOBLECK_NAMESPACE", "value": namespace},
        {"name": "OOBLECK_NODE", "value": name},
        {"name": "OOBLECK_PLAN_CONFIGMAP", "value": plan_name(job)},
        {"name": "OOBLECK_STORE", "value": store_address(job, namespace)},
        {"name": "OOBLECK_GPUS_PER_NODE", "value": str(spec.gpus_per_node)},
        {"name": "OOBLECK_DEVICE", "value": spec.device},
        *({"name": e.name, "value": e.value} for e in spec.pod.env),
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    # NCCL and the data loader need more shared memory than the container runtime's 64 MiB default.
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if spec.data.claim_name and spec.data.path:
        directory = spec.data.path.rsplit("/", 1)[0] or "/"
        mounts.append({"name": "data", "mountPath": directory, "readOnly": True})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": spec.data.claim_name, "readOnly": True}})
    if spec.checkpoint is not None and spec.checkpoint.claim_name:
        mounts.append({"name": "checkpoints", "mountPath": spec.checkpoint.path})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.checkpoint.claim_name}})
    pod_security, container_security = _security()
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": service_name(job),
        "serviceAccountName": rbac_name(job),
        "securityContext": pod_security,
        "terminationGracePeriodSeconds": 10,
        # One worker per node: two pods of a job on one machine would fail together.
        "affinity": {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {JOB_LABEL: job, ROLE_LABEL: WORKER_ROLE}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        },
        "containers": [
            {
                "name": "worker",
                "image": spec.image or default_image,
                "command": list(spec.command or default_command),
                "env": env,
                "ports": [{"name": "worker", "containerPort": WORKER_PORT}],
                "resources": {"requests": requests, "limits": limits},
                "securityContext": container_security,
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if spec.pod.node_selector:
        pod_spec["nodeSelector"] = dict(spec.pod.node_selector)
    if spec.pod.tolerations:
        pod_spec["tolerations"] = [t.model_dump(mode="json", exclude_none=True, by_alias=True) for t in spec.pod.tolerations]
    if spec.pod.priority_class_name:
        pod_spec["priorityClassName"] = spec.pod.priority_class_name
    metadata = _meta(name, namespace, job, uid, {**spec.pod.labels, ROLE_LABEL: WORKER_ROLE, INDEX_LABEL: str(index)})
    metadata["annotations"] = dict(spec.pod.annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def coordinator_pod(job: str, namespace: str, uid: str, spec: OobleckJobSpec, *, default_image: str) -> dict[str, Any]:
    """The coordinator Pod: hosts the job's TCPStore; restarted in place (its loss is recoverable)."""
    pod_security, container_security = _security()
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "hostname": coordinator_name(job),
        "subdomain": service_name(job),
        "serviceAccountName": rbac_name(job),
        "automountServiceAccountToken": False,
        "securityContext": pod_security,
        "containers": [
            {
                "name": "coordinator",
                "image": spec.image or default_image,
                "command": ["python", "-m", "oobleck.runtime.coordinator", "--port", str(STORE_PORT)],
                "ports": [{"name": "store", "containerPort": STORE_PORT}],
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
                "securityContext": container_security,
            }
        ],
    }
    if spec.pod.node_selector:
        pod_spec["nodeSelector"] = dict(spec.pod.node_selector)
    if spec.pod.tolerations:
        pod_spec["tolerations"] = [t.model_dump(mode="json", exclude_none=True, by_alias=True) for t in spec.pod.tolerations]
    metadata = _meta(coordinator_name(job), namespace, job, uid, {ROLE_LABEL: COORDINATOR_ROLE})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def headless_service(job: str, namespace: str, uid: str) -> dict[str, Any]:
    """The headless Service that gives every pod of the job a DNS name (also before it is ready)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(service_name(job), namespace, job, uid),
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: job},
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": "store", "port": STORE_PORT, "targetPort": STORE_PORT},
                {"name": "worker", "port": WORKER_PORT, "targetPort": WORKER_PORT},
            ],
        },
    }


def service_account(job: str, namespace: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(rbac_name(job), namespace, job, uid)}


def worker_role(job: str, namespace: str, uid: str) -> dict[str, Any]:
    """Least privilege for workers: read their plan ConfigMap and their job, report on pods (annotations)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(rbac_name(job), namespace, job, uid),
        "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [plan_name(job)], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [GROUP], "resources": ["oobleckjobs"], "resourceNames": [job], "verbs": ["get"]},
            # A worker writes FAILURE_ANNOTATION / PROGRESS_ANNOTATION on its own pod (RBAC cannot name
            # pods created later, so the rule covers the namespace's pods; no create or delete).
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]},
        ],
    }


def worker_role_binding(job: str, namespace: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(rbac_name(job), namespace, job, uid),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rbac_name(job)},
        "subjects": [{"kind": "ServiceAccount", "name": rbac_name(job), "namespace": namespace}],
    }


def static_children(job: str, namespace: str, uid: str) -> list[dict[str, Any]]:
    """The children that never change after creation, in creation order (the Role before its binding)."""
    return [
        service_account(job, namespace, uid),
        worker_role(job, namespace, uid),
        worker_role_binding(job, namespace, uid),
        headless_service(job, namespace, uid),
    ]


def plan_config_map(
    job: str, namespace: str, uid: str, plan: Plan, profile: ModelProfile, spec: OobleckJobSpec, failures_survived: int
) -> dict[str, Any]:
    """The plan ConfigMap for one generation (see the module docstring for its keys)."""
    text = plan.to_json()
    data = {PROFILE_KEY: profile.model_dump_json(), JOB_KEY: json.dumps(spec.to_kubernetes(), sort_keys=True)}
    body: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(plan_name(job), namespace, job, uid)}
    body["metadata"]["annotations"] = {
        GENERATION_ANNOTATION: str(plan.generation),
        FAILURES_SURVIVED_ANNOTATION: str(failures_survived),
    }
    if len(text) > PLAN_INLINE_LIMIT:
        # mtime=0: the same plan always gives the same bytes.
        body["binaryData"] = {PLAN_GZ_KEY: base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode()}
        data[PLAN_KEY] = ""
    else:
        data[PLAN_KEY] = text
        body["binaryData"] = {}
    body["data"] = data
    return body


def plan_patch(body: dict[str, Any]) -> dict[str, Any]:
    """A merge patch turning any earlier plan ConfigMap into `body` (drops a stale gzipped plan)."""
    binary: dict[str, Any] = dict(body.get("binaryData") or {})
    if PLAN_GZ_KEY not in binary:
        binary[PLAN_GZ_KEY] = None
    return {"metadata": {"annotations": body["metadata"]["annotations"]}, "data": body["data"], "binaryData": binary}


def read_plan(config_map: dict[str, Any]) -> Plan:
    """The Plan in a plan ConfigMap (either form); raises ValueError naming the key if it is invalid."""
    binary = (config_map.get("binaryData") or {}).get(PLAN_GZ_KEY)
    try:
        if binary:
            text = gzip.decompress(base64.b64decode(binary)).decode()
            key = PLAN_GZ_KEY
        else:
            text = (config_map.get("data") or {}).get(PLAN_KEY) or ""
            key = PLAN_KEY
        return Plan.model_validate_json(text)
    except (ValueError, OSError) as error:
        name = (config_map.get("metadata") or {}).get("name", "?")
        raise ValueError(f"configmap {name}: key {key}: not a valid plan: {error}") from error


def read_profile(config_map: dict[str, Any]) -> ModelProfile | None:
    """The profile stored beside the plan, or None when the ConfigMap has none."""
    text = (config_map.get("data") or {}).get(PROFILE_KEY)
    return ModelProfile.model_validate_json(text) if text else None


def read_failures_survived(config_map: dict[str, Any]) -> int:
    value = ((config_map.get("metadata") or {}).get("annotations") or {}).get(FAILURES_SURVIVED_ANNOTATION, "0")
    return int(value) if value.isdigit() else 0
