"""Manifests of an OobleckJob's children, as plain dicts: pure functions of the spec and the plan.

Children (all named deterministically and owned by the job through a controller ownerReference, so
that deleting the job garbage-collects them and a retried create answers 409 instead of duplicating):

    <job>-worker-<i>     a worker Pod per node (index i never changes for the pod's life)
    <job>-coordinator    the Pod hosting the rendezvous store (outlives any worker)
    <job>-workers        a headless Service: stable DNS names for the pods above
    <job>-plan           the ConfigMap holding the versioned plan (the source of truth)
    <job>-oobleck-worker the ServiceAccount, Role and RoleBinding of the workers (see WORKER_ACCOUNT_SUFFIX)

The contract with the runtime - the worker container's environment (built here as a
oobleck.api.contract.PodContract, parsed by the pod), the ports, the exit codes and the annotations -
is oobleck.api.contract. The plan ConfigMap's keys and the plan's encoding are oobleck.api.planmap's:
`plan.json` (or `plan.json.gz` in binaryData above PLAN_INLINE_LIMIT bytes), `profile.json` (the
ModelProfile planned with), `job.json` (the spec, camelCase); GENERATION_ANNOTATION on it equals the
plan's generation. The operator replaces the plan as a whole and only ever increases its generation,
and patches a worker pod's RANKS_ANNOTATION only when its ranks change and only *after* the ConfigMap
holds the generation (the planner keeps ranks across generations, so one lost node renumbers about
one pod). A worker takes the current generation from the ConfigMap, never from its pod; it connects
to the coordinator pod's status.podIP read through the API, and to OOBLECK_STORE's DNS name only when
it cannot read it. On its own pod it reports failures (kind "unrecoverable" fails the job; a report
naming nobody that no pod or node status explains within 5 s makes the operator redo the generation
on the same nodes), progress (a step >= spec.training.steps completes the job; a replacement pod is
folded in only once it wrote "up, waiting for a plan" and the current generation has trained a step)
and, for `profile: measure`, the profile it measured (the lowest-indexed worker's plans generation 0).
A worker that fails because of the job itself writes CAUSE_ANNOTATION first (oobleck.api.causes: kind,
message, field/path/layer/step) and exits with the kind's code; operator/faults.py fails the job with it
once it is certain. The worker container's terminationMessagePolicy FallbackToLogsOnError puts a failed
container's last log lines in its status, for workers that die before they can report.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import kopf

from oobleck.api.contract import (
    FAILURES_SURVIVED_ANNOTATION,
    GENERATION_ANNOTATION,
    METRICS_PORTS,
    RANKS_ANNOTATION,
    STORE_PORT,
    WORKER_PORT,
    PodContract,
    pod_ip_env,
)
from oobleck.api.plan import Plan
from oobleck.api.planmap import (
    JOB_KEY,
    PLAN_GZ_KEY,
    PLAN_INLINE_LIMIT,
    PROFILE_KEY,
    encode_plan,
)
from oobleck.api.profile import ModelProfile
from oobleck.api.resource import API_VERSION, COORDINATOR_ROLE, GROUP, JOB_LABEL, KIND, ROLE_LABEL, WORKER_ROLE
from oobleck.api.schema import JOB_KEY_DIR, MODEL_CONFIG_DIR, SHM_DIR, data_directory
from oobleck.api.spec import OobleckJobSpec

INDEX_LABEL = f"{GROUP}/worker-index"

# Pod names are `<job>-worker-<index>`: the job name is at most 40 characters (api.resource.MAX_NAME_LENGTH),
# which leaves room for any index below a million within the 63-character hostname limit.


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def coordinator_name(job: str) -> str:
    return f"{job}-coordinator"


def service_name(job: str) -> str:
    return f"{job}-workers"


def plan_name(job: str) -> str:
    return f"{job}-plan"


WORKER_ACCOUNT_SUFFIX = "-oobleck-worker"
"""names the workers' ServiceAccount (and Role, RoleBinding); the cluster's worker-pod admission policy keys on it
(charts/oobleck-operator/files/admission/worker-pods.yaml), so it must not look like anyone else's account"""


def rbac_name(job: str) -> str:
    return f"{job}{WORKER_ACCOUNT_SUFFIX}"


def worker_index(job: str, pod_name: str) -> int | None:
    """The index in `<job>-worker-<index>`, or None if the name is not a worker's of this job."""
    prefix = f"{job}-worker-"
    tail = pod_name[len(prefix) :] if pod_name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and str(int(tail)) == tail else None


def key_name(job: str) -> str:
    return f"{job}-key"


def isolation_name(job: str) -> str:
    return f"{job}-isolation"


JOB_KEY_ITEM = "key"


def store_address(job: str, namespace: str) -> str:
    return f"{coordinator_name(job)}.{service_name(job)}.{namespace}.svc:{STORE_PORT}"


def owner(job: str, namespace: str, uid: str) -> dict[str, Any]:
    """The job as the owner kopf.adopt reads: its identity only (no labels: children get their own)."""
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": job, "namespace": namespace, "uid": uid}}


def _meta(name: str, namespace: str, job: str, uid: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A child's metadata: its name, the job's label, and the controller ownerReference (`kopf.adopt`,
    strict: the deterministic name stays) that garbage-collects it with the job."""
    meta = {"name": name, "namespace": namespace, "labels": {JOB_LABEL: job, **(labels or {})}}
    kopf.adopt({"metadata": meta}, owner=owner(job, namespace, uid), strict=True)
    return meta


def ranks_table(plan: Plan) -> dict[str, str]:
    """RANKS_ANNOTATION for every node of the plan: its ranks for local GPUs 0..G-1 (one pass over the stages)."""
    by_node: dict[str, dict[int, int]] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            by_node.setdefault(stage.node, {}).update(zip(stage.gpus, stage.ranks))
    return {
        node: ",".join(str(ranks.get(gpu, "")) for gpu in range(plan.gpus_per_node)) for node, ranks in by_node.items()
    }


def ranks_value(plan: Plan | None, node: str, gpus_per_node: int) -> str:
    """RANKS_ANNOTATION for `node` alone, or "" when it is not in the plan."""
    if plan is None:
        return ""
    ranks = [plan.rank_of(node, gpu) for gpu in range(gpus_per_node)]
    if all(rank is None for rank in ranks):
        return ""
    return ",".join("" if rank is None else str(rank) for rank in ranks)


def worker_annotations(plan: Plan, node: str, table: dict[str, str] | None = None) -> dict[str, str]:
    """The annotations that tell a worker pod its ranks in `plan` (the patch sent after the plan is
    written, when they changed). Pass `ranks_table(plan)` when annotating many pods."""
    ranks = table.get(node, "") if table is not None else ranks_value(plan, node, plan.gpus_per_node)
    return {GENERATION_ANNOTATION: str(plan.generation), RANKS_ANNOTATION: ranks}


def annotations_current(
    plan: Plan, node: str, annotations: dict[str, str] | None, table: dict[str, str] | None = None
) -> bool:
    """Whether a pod's annotations are up to date with `plan`: its RANKS_ANNOTATION is the plan's. The
    operator patches exactly the running member pods for which this is False (decide.py)."""
    ranks = table.get(node, "") if table is not None else ranks_value(plan, node, plan.gpus_per_node)
    return (annotations or {}).get(RANKS_ANNOTATION) == ranks


IMAGE_UID = 65532
"""the image's user and group (Dockerfile): workers run as it, and fsGroup makes a fresh claim writable by it"""


def _security() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_UID,
        "runAsGroup": IMAGE_UID,
        "fsGroup": IMAGE_UID,
        # Only a volume's root is checked: a large checkpoint claim is not re-chowned file by file at each start.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod, container


def worker_pod(
    job: str,
    namespace: str,
    uid: str,
    spec: OobleckJobSpec,
    index: int,
    *,
    default_image: str,
    default_command: list[str],
) -> dict[str, Any]:
    """The worker Pod `<job>-worker-<index>`: one per node, `gpusPerNode` GPUs, never restarted in place
    (a dead worker is a lost node: the operator re-plans without it and creates a replacement)."""
    name = worker_name(job, index)
    requests, limits = _worker_resources(spec)
    env = _worker_env(job, namespace, name, spec)
    mounts, volumes = _worker_volumes(job, spec)
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
                # A worker that dies before its runtime reports anything still says why (operator/faults.py).
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "securityContext": container_security,
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if spec.pod.node_selector:
        pod_spec["nodeSelector"] = dict(spec.pod.node_selector)
    if spec.pod.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(mode="json", exclude_none=True, by_alias=True) for t in spec.pod.tolerations
        ]
    if spec.pod.priority_class_name:
        pod_spec["priorityClassName"] = spec.pod.priority_class_name
    metadata = _meta(name, namespace, job, uid, {**spec.pod.labels, ROLE_LABEL: WORKER_ROLE, INDEX_LABEL: str(index)})
    metadata["annotations"] = dict(spec.pod.annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _worker_resources(spec: OobleckJobSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """A worker container's requests and limits: memory is also its limit, CPU is not limited."""
    requests: dict[str, Any] = {"cpu": str(spec.resources.cpu), "memory": str(spec.resources.memory)}
    limits: dict[str, Any] = {"memory": str(spec.resources.memory)}
    if spec.device == "cuda":
        requests[spec.gpu_resource_name] = str(spec.gpus_per_node)
        limits[spec.gpu_resource_name] = str(spec.gpus_per_node)
    return requests, limits


def _worker_env(job: str, namespace: str, name: str, spec: OobleckJobSpec) -> list[dict[str, Any]]:
    """The worker container's environment: the operator-pod contract, then the job's own variables."""
    contract = PodContract(
        job=job,
        namespace=namespace,
        node=name,
        plan_config_map=plan_name(job),
        store=store_address(job, namespace),
        gpus_per_node=spec.gpus_per_node,
        device=spec.device,
        # The model to profile before the first plan exists (`profile: measure`); afterwards the plan
        # ConfigMap's job.json is what the worker reads.
        job_spec=json.dumps(spec.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=True),
        job_key_file=f"{JOB_KEY_DIR}/{JOB_KEY_ITEM}",
    )
    return [
        *contract.to_env(),
        pod_ip_env(),
        # A valueFrom stays a reference: the kubelet reads the Secret, the operator never does.
        *(e.to_kubernetes() for e in spec.pod.env),
    ]


def _worker_volumes(job: str, spec: OobleckJobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The worker container's volume mounts and the pod's volumes: shared memory, the job key, and the
    claims and ConfigMaps the spec names."""
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": SHM_DIR},
        {"name": "job-key", "mountPath": JOB_KEY_DIR, "readOnly": True},
    ]
    volumes: list[dict[str, Any]] = [
        # NCCL and the data loader need more shared memory than the container runtime's 64 MiB default.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        # The key every message between the job's workers is signed with (runtime/elastic/signing.py).
        {"name": "job-key", "secret": {"secretName": key_name(job), "defaultMode": 0o444}},
    ]
    if spec.data.claim_name and spec.data.path:
        directory = data_directory(spec.data.path)  # never "" or reserved: the API server's rules
        mounts.append({"name": "data", "mountPath": directory, "readOnly": True})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": spec.data.claim_name, "readOnly": True}})
    hf = spec.model.transformers
    if hf is not None and hf.config_map is not None:  # the runtime reads MODEL_CONFIG_DIR/<key>
        mounts.append({"name": "model-config", "mountPath": MODEL_CONFIG_DIR, "readOnly": True})
        items = [{"key": hf.config_map.key, "path": hf.config_map.key}]
        volumes.append({"name": "model-config", "configMap": {"name": hf.config_map.name, "items": items}})
    if hf is not None and hf.init_from is not None and hf.init_from.claim_name:
        mounts.append({"name": "init-from", "mountPath": hf.init_from.path, "readOnly": True})
        claim = {"claimName": hf.init_from.claim_name, "readOnly": True}
        volumes.append({"name": "init-from", "persistentVolumeClaim": claim})
    if spec.checkpoint is not None and spec.checkpoint.claim_name:
        mounts.append({"name": "checkpoints", "mountPath": spec.checkpoint.path})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.checkpoint.claim_name}})
    return mounts, volumes


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
                "command": ["python", "-m", "oobleck.runtime.elastic.coordinator", "--port", str(STORE_PORT)],
                "env": [pod_ip_env()],
                "ports": [{"name": "store", "containerPort": STORE_PORT}],
                # The store's process imports torch: ~580 MB resident (a 512Mi limit OOM-kills it).
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                "securityContext": container_security,
            }
        ],
    }
    if spec.pod.node_selector:
        pod_spec["nodeSelector"] = dict(spec.pod.node_selector)
    if spec.pod.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(mode="json", exclude_none=True, by_alias=True) for t in spec.pod.tolerations
        ]
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
    """Least privilege for workers, exactly what runtime/backends/pod/main.py calls: get / list / watch their plan
    ConfigMap and get the coordinator pod (its IP), both by name, and patch pods. RBAC cannot name pods
    created later, so the patch rule covers the namespace's pods; the cluster's admission policy
    (charts/oobleck-operator/files/admission/worker-pods.yaml) narrows it to the token's own pod and the
    runtime's report annotations."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(rbac_name(job), namespace, job, uid),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [plan_name(job)],
                "verbs": ["get", "list", "watch"],
            },
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": [coordinator_name(job)], "verbs": ["get"]},
            # A worker writes its report annotations on its own pod (no create or delete).
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
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


def job_key_secret(job: str, namespace: str, uid: str, key: bytes) -> dict[str, Any]:
    """The job's key (`key`: random bytes the caller draws), created once; worker pods mount it. Every store
    value and snapshot push a worker acts on is signed with it (runtime/elastic/signing.py), so a stranger on
    the pod network, or another job, cannot steer this one."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(key_name(job), namespace, job, uid),
        "type": "Opaque",
        "data": {JOB_KEY_ITEM: base64.b64encode(key).decode()},
    }


def network_policy(job: str, namespace: str, uid: str, scrape_namespace: str | None) -> dict[str, Any]:
    """Ingress to the job's pods from the job's pods only, plus the workers' metrics ports from
    `scrape_namespace` (Prometheus'), if given. Enforced where the cluster's network plugin enforces
    NetworkPolicy."""
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": {JOB_LABEL: job}}}]}]
    if scrape_namespace:
        ingress.append(
            {
                "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": scrape_namespace}}}],
                "ports": [{"protocol": "TCP", "port": WORKER_PORT, "endPort": WORKER_PORT + METRICS_PORTS - 1}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(isolation_name(job), namespace, job, uid),
        "spec": {"podSelector": {"matchLabels": {JOB_LABEL: job}}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def static_children(job: str, namespace: str, uid: str, scrape_namespace: str | None = None) -> list[dict[str, Any]]:
    """The children that never change after creation, in creation order (the Role before its binding; the
    job's key Secret is created beside them with a key drawn at the edge, operator/apply.py)."""
    return [
        service_account(job, namespace, uid),
        worker_role(job, namespace, uid),
        worker_role_binding(job, namespace, uid),
        headless_service(job, namespace, uid),
        network_policy(job, namespace, uid, scrape_namespace),
    ]


def plan_config_map(
    job: str, namespace: str, uid: str, plan: Plan, profile: ModelProfile, spec: OobleckJobSpec, failures_survived: int
) -> dict[str, Any]:
    """The plan ConfigMap for one generation (see the module docstring for its keys)."""
    data = {PROFILE_KEY: profile.model_dump_json(), JOB_KEY: json.dumps(spec.to_kubernetes(), sort_keys=True)}
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan_name(job), namespace, job, uid),
    }
    body["metadata"]["annotations"] = {
        GENERATION_ANNOTATION: str(plan.generation),
        FAILURES_SURVIVED_ANNOTATION: str(failures_survived),
    }
    plan_data, binary = encode_plan(plan, PLAN_INLINE_LIMIT)
    data.update(plan_data)
    body["binaryData"] = binary
    body["data"] = data
    return body


def plan_patch(body: dict[str, Any]) -> dict[str, Any]:
    """A merge patch turning any earlier plan ConfigMap into `body` (drops a stale gzipped plan)."""
    binary: dict[str, Any] = dict(body.get("binaryData") or {})
    if PLAN_GZ_KEY not in binary:
        binary[PLAN_GZ_KEY] = None
    return {"metadata": {"annotations": body["metadata"]["annotations"]}, "data": body["data"], "binaryData": binary}
