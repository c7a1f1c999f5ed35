"""What a kubelet computes before it starts a container: environment variables and volume contents.

Pure functions over plain pod dicts (as the API returns them). The API objects a pod refers to
(ConfigMaps, Secrets, service-account tokens) are fetched by the caller: `references(pod)` says
which, `Sources` carries them back in, and `container_env` / `volume_contents` resolve against it.
Errors say which field failed, the way the kubelet's CreateContainerConfigError / FailedMount do.

Supported: env (value, $(VAR) expansion, valueFrom fieldRef / resourceFieldRef / configMapKeyRef /
secretKeyRef), envFrom (configMapRef, secretRef, prefix), volumes configMap, secret, downwardAPI,
emptyDir, projected (configMap, secret, downwardAPI, serviceAccountToken), hostPath and
persistentVolumeClaim (a folder on this machine; see `VolumeContent.host_path`).
"""

from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

DEFAULT_FILE_MODE = 0o644
# The kubelet's default for a projected token without expirationSeconds (1 h).
DEFAULT_TOKEN_EXPIRATION_S = 3600


class PodConfigError(ValueError):
    """The pod cannot be started as specified; the message names the field (CreateContainerConfigError)."""


class MountError(ValueError):
    """A volume cannot be set up yet or at all; the message names the volume (FailedMount)."""


# --- quantities ----------------------------------------------------------------------------------

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")


def parse_quantity(text: str | int | float, what: str = "quantity") -> Fraction:
    """A Kubernetes resource quantity ("500m", "4Gi", "1e3", 2) as an exact number."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise PodConfigError(f"{what}: not a Kubernetes quantity: {text!r}")
    number, exponent, suffix = match.groups()
    value = Fraction(number)
    if exponent:
        value *= Fraction(10) ** int(exponent[1:])
    elif suffix:
        value *= _BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix]
    return value


# --- what to fetch -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenRequest:
    """A service-account token bound to the pod, as a projected volume asks for it."""

    audience: str  # "" = the API server's own audience
    expiration_s: int


def token_request(projection: dict) -> TokenRequest:
    """The token a `serviceAccountToken` projection asks for."""
    expiration = int(projection.get("expirationSeconds") or DEFAULT_TOKEN_EXPIRATION_S)
    return TokenRequest(projection.get("audience") or "", expiration)


@dataclass
class References:
    """The API objects a pod's env and volumes name; `optional` ones may be missing."""

    configmaps: set[str] = field(default_factory=set)
    secrets: set[str] = field(default_factory=set)
    tokens: set[TokenRequest] = field(default_factory=set)


@dataclass
class Sources:
    """Fetched objects: name -> {key: bytes}, or None where the object does not exist."""

    configmaps: dict[str, dict[str, bytes] | None] = field(default_factory=dict)
    secrets: dict[str, dict[str, bytes] | None] = field(default_factory=dict)
    tokens: dict[TokenRequest, str] = field(default_factory=dict)


def configmap_data(configmap: dict) -> dict[str, bytes]:
    """A ConfigMap's `data` and `binaryData` as bytes."""
    data = {key: value.encode() for key, value in (configmap.get("data") or {}).items()}
    data.update({key: base64.b64decode(value) for key, value in (configmap.get("binaryData") or {}).items()})
    return data


def secret_data(secret: dict) -> dict[str, bytes]:
    """A Secret's `data` (base64 on the wire) and `stringData` as bytes."""
    data = {key: base64.b64decode(value) for key, value in (secret.get("data") or {}).items()}
    data.update({key: value.encode() for key, value in (secret.get("stringData") or {}).items()})
    return data


def _containers(pod: dict) -> list[dict]:
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def references(pod: dict) -> References:
    """Every ConfigMap, Secret and token the pod's env and volumes refer to."""
    refs = References()
    for container in _containers(pod):
        for source in container.get("envFrom") or []:
            if "configMapRef" in source:
                refs.configmaps.add(source["configMapRef"]["name"])
            if "secretRef" in source:
                refs.secrets.add(source["secretRef"]["name"])
        for var in container.get("env") or []:
            value_from = var.get("valueFrom") or {}
            if "configMapKeyRef" in value_from:
                refs.configmaps.add(value_from["configMapKeyRef"]["name"])
            if "secretKeyRef" in value_from:
                refs.secrets.add(value_from["secretKeyRef"]["name"])
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        if "configMap" in volume:
            refs.configmaps.add(volume["configMap"]["name"])
        if "secret" in volume:
            refs.secrets.add(volume["secret"]["secretName"])
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "configMap" in source:
                refs.configmaps.add(source["configMap"]["name"])
            if "secret" in source:
                refs.secrets.add(source["secret"]["name"])
            if "serviceAccountToken" in source:
                refs.tokens.add(token_request(source["serviceAccountToken"]))
    return refs


# --- field and resource references ---------------------------------------------------------------

_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def field_value(pod: dict, path: str, where: str, volume: bool = False) -> str:
    """The downward-API value of `path` (e.g. "metadata.name", "metadata.labels['app']", "status.podIP")."""
    metadata, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    subscript = _SUBSCRIPT.match(path)
    if subscript:
        return (metadata.get(subscript.group(1)) or {}).get(subscript.group(2), "")
    if volume and path in ("metadata.labels", "metadata.annotations"):
        # Volumes get whole maps as `key="value"` lines, sorted (as the kubelet formats them).
        items = sorted((metadata.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{key}="{_escape(value)}"' for key, value in items)
    simple = {
        "metadata.name": metadata.get("name", ""),
        "metadata.namespace": metadata.get("namespace", ""),
        "metadata.uid": metadata.get("uid", ""),
    }
    if not volume:
        simple.update(
            {
                "spec.nodeName": spec.get("nodeName", ""),
                "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                "status.podIP": status.get("podIP", ""),
                "status.hostIP": status.get("hostIP", ""),
                "status.podIPs": ",".join(entry["ip"] for entry in status.get("podIPs") or []),
                "status.hostIPs": ",".join(entry["ip"] for entry in status.get("hostIPs") or []),
            }
        )
    if path not in simple:
        raise PodConfigError(f"{where}.fieldRef.fieldPath: unsupported field {path!r}")
    return simple[path]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def resource_value(pod: dict, ref: dict, default_container: str | None, allocatable: dict[str, str], where: str) -> str:
    """A resourceFieldRef ("limits.cpu", divisor) as the kubelet renders it: ceil(value / divisor).

    An unset limit falls back to the node's allocatable, as on a real node.
    """
    container_name = ref.get("containerName") or default_container
    containers = {c["name"]: c for c in _containers(pod)}
    if container_name not in containers:
        raise PodConfigError(f"{where}.resourceFieldRef.containerName: no container {container_name!r} in the pod")
    resource = ref.get("resource", "")
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory", "ephemeral-storage"):
        raise PodConfigError(f"{where}.resourceFieldRef.resource: unsupported resource {resource!r}")
    resources = containers[container_name].get("resources") or {}
    raw = (resources.get(kind) or {}).get(name)
    if raw is None and kind == "limits":
        raw = allocatable.get(name, "0")
    value = parse_quantity(raw if raw is not None else "0", f"{where}.resourceFieldRef ({resource})")
    divisor = parse_quantity(ref.get("divisor") or "1", f"{where}.resourceFieldRef.divisor")
    if divisor <= 0:
        raise PodConfigError(f"{where}.resourceFieldRef.divisor: must be > 0, got {ref.get('divisor')!r}")
    return str(math.ceil(value / divisor))


# --- environment ---------------------------------------------------------------------------------

_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def expand(text: str, mapping: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, `$$` is a literal `$`, the rest stays."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "$" and i + 1 < len(text):
            following = text[i + 1]
            if following == "$":
                out.append("$")
                i += 2
                continue
            if following == "(":
                end = text.find(")", i + 2)
                if end != -1 and text[i + 2 : end] in mapping:
                    out.append(mapping[text[i + 2 : end]])
                    i = end + 1
                    continue
        out.append(char)
        i += 1
    return "".join(out)


def _lookup(
    kind: str, store: dict[str, dict[str, bytes] | None], ref: dict, where: str, key: str | None = None
) -> bytes | dict[str, bytes] | None:
    """An object's data (or one key of it); None if missing and optional, else PodConfigError."""
    name = ref.get("name", "")
    data = store.get(name)
    optional = bool(ref.get("optional"))
    if data is None:
        if optional:
            return None
        raise PodConfigError(f"{where}: {kind} {name!r} not found")
    if key is None:
        return data
    if key not in data:
        if optional:
            return None
        raise PodConfigError(f"{where}: key {key!r} not found in {kind} {name!r}")
    return data[key]


def container_env(
    pod: dict, container: dict, sources: Sources, allocatable: dict[str, str], base: dict[str, str]
) -> dict[str, str]:
    """The container's environment: `base` (the image's and the agent's), then envFrom, then env, in order.

    `pod` must carry the status the container will see (podIP, hostIP), as fieldRefs read it.
    """
    env = dict(base)
    name = container.get("name", "")
    for index, source in enumerate(container.get("envFrom") or []):
        where = f"containers[{name}].envFrom[{index}]"
        if "configMapRef" in source:
            data = _lookup("configmap", sources.configmaps, source["configMapRef"], f"{where}.configMapRef")
        elif "secretRef" in source:
            data = _lookup("secret", sources.secrets, source["secretRef"], f"{where}.secretRef")
        else:
            raise PodConfigError(f"{where}: needs configMapRef or secretRef")
        prefix = source.get("prefix", "")
        for key, value in (data or {}).items():  # type: ignore[union-attr]
            if _ENV_NAME.match(prefix + key):  # the kubelet skips invalid names too
                env[prefix + key] = value.decode(errors="replace")
    for var in container.get("env") or []:
        where = f"containers[{name}].env[{var.get('name')}]"
        value_from = var.get("valueFrom")
        if value_from is None:
            env[var["name"]] = expand(var.get("value", ""), env)
            continue
        if "fieldRef" in value_from:
            value: str | None = field_value(pod, value_from["fieldRef"]["fieldPath"], f"{where}.valueFrom")
        elif "resourceFieldRef" in value_from:
            value = resource_value(pod, value_from["resourceFieldRef"], name, allocatable, f"{where}.valueFrom")
        elif "configMapKeyRef" in value_from:
            ref = value_from["configMapKeyRef"]
            raw = _lookup("configmap", sources.configmaps, ref, f"{where}.valueFrom.configMapKeyRef", ref["key"])
            value = None if raw is None else raw.decode(errors="replace")  # type: ignore[union-attr]
        elif "secretKeyRef" in value_from:
            ref = value_from["secretKeyRef"]
            raw = _lookup("secret", sources.secrets, ref, f"{where}.valueFrom.secretKeyRef", ref["key"])
            value = None if raw is None else raw.decode(errors="replace")  # type: ignore[union-attr]
        else:
            raise PodConfigError(f"{where}.valueFrom: unsupported source {sorted(value_from)}")
        if value is not None:
            env[var["name"]] = value
    return env


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expanded. Without `command` the args run as the command (an image
    with no ENTRYPOINT); the image itself is not known here, so one of them is required."""
    command = [expand(part, env) for part in container.get("command") or []]
    args = [expand(part, env) for part in container.get("args") or []]
    argv = command + args
    if not argv:
        raise PodConfigError(
            f"containers[{container.get('name')}].command: required on local nodes "
            "(the image's entrypoint is not known)"
        )
    return argv


# --- devices -------------------------------------------------------------------------------------


def device_counts(pod: dict, resource: str) -> tuple[dict[str, int], dict[str, int]]:
    """Devices of `resource` per init container and per container (limits, else requests)."""

    def count(container: dict) -> int:
        resources = container.get("resources") or {}
        value = (resources.get("limits") or {}).get(resource, (resources.get("requests") or {}).get(resource, 0))
        return int(parse_quantity(value, f"containers[{container.get('name')}].resources ({resource})"))

    spec = pod.get("spec") or {}
    return (
        {c["name"]: count(c) for c in spec.get("initContainers") or []},
        {c["name"]: count(c) for c in spec.get("containers") or []},
    )


def device_plan(init: dict[str, int], main: dict[str, int], slots: list[int]) -> dict[str, list[int]]:
    """Which of the pod's device slots each container gets, as the kubelet's device manager does:
    containers get disjoint slices in order; init containers reuse the first slots (they run before)."""
    plan: dict[str, list[int]] = {}
    start = 0
    for name, n in main.items():
        plan[name] = slots[start : start + n]
        start += n
    for name, n in init.items():
        plan[name] = slots[:n]
    return plan


def pod_device_total(init: dict[str, int], main: dict[str, int]) -> int:
    """Devices a pod holds: its containers' sum, or its largest init container if that is more."""
    return max(sum(main.values()), max(init.values(), default=0))


# --- volumes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VolumeContent:
    """What one volume holds: files to write, an empty folder, or a folder of this machine.

    `files`: relative path -> (content, mode), for configMap/secret/downwardAPI/projected.
    `host_path`: hostPath's path, or for persistentVolumeClaim the claim's name (the caller maps
    it to a folder kept per claim, shared by the pods that mount it). Neither: an emptyDir.
    """

    name: str
    files: dict[str, tuple[bytes, int]] | None = None
    host_path: str | None = None
    claim: str | None = None


def _safe_relative(path: str, where: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or ".." in parts:
        raise PodConfigError(f"{where}: path must be relative without '..', got {path!r}")
    return path


def _key_files(data: dict[str, bytes], source: dict, mode: int, where: str) -> dict[str, tuple[bytes, int]]:
    items = source.get("items")
    if not items:
        return {_safe_relative(key, where): (value, mode) for key, value in data.items()}
    files = {}
    for item in items:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise MountError(f"{where}: key {item['key']!r} not found")
        path = _safe_relative(item["path"], f"{where}.items[{item['key']}]")
        files[path] = (data[item["key"]], item.get("mode", mode))
    return files


def _downward_files(
    pod: dict, items: list[dict], mode: int, allocatable: dict[str, str], where: str
) -> dict[str, tuple[bytes, int]]:
    files = {}
    for item in items:
        item_where = f"{where}.items[{item.get('path')}]"
        if "fieldRef" in item:
            value = field_value(pod, item["fieldRef"]["fieldPath"], item_where, volume=True)
        elif "resourceFieldRef" in item:
            value = resource_value(pod, item["resourceFieldRef"], None, allocatable, item_where)
        else:
            raise PodConfigError(f"{item_where}: needs fieldRef or resourceFieldRef")
        files[_safe_relative(item["path"], item_where)] = (value.encode(), item.get("mode", mode))
    return files


def _object_files(kind: str, store: dict, source: dict, name_key: str, mode: int, where: str) -> dict:
    name = source.get(name_key, "")
    data = store.get(name)
    if data is None:
        if source.get("optional"):
            return {}
        raise MountError(f"{where}: {kind} {name!r} not found")
    return _key_files(data, source, source.get("defaultMode", mode), where)


def volume_contents(pod: dict, sources: Sources, allocatable: dict[str, str]) -> list[VolumeContent]:
    """The contents of every volume of the pod; MountError names a volume that cannot be set up."""
    contents = []
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        name = volume["name"]
        where = f"volumes[{name}]"
        if "emptyDir" in volume:
            contents.append(VolumeContent(name))
        elif "hostPath" in volume:
            contents.append(VolumeContent(name, host_path=volume["hostPath"]["path"]))
        elif "persistentVolumeClaim" in volume:
            contents.append(VolumeContent(name, claim=volume["persistentVolumeClaim"]["claimName"]))
        elif "configMap" in volume:
            source = volume["configMap"]
            files = _object_files(
                "configmap", sources.configmaps, source, "name", DEFAULT_FILE_MODE, f"{where}.configMap"
            )
            contents.append(VolumeContent(name, files=files))
        elif "secret" in volume:
            source = volume["secret"]
            files = _object_files("secret", sources.secrets, source, "secretName", DEFAULT_FILE_MODE, f"{where}.secret")
            contents.append(VolumeContent(name, files=files))
        elif "downwardAPI" in volume:
            source = volume["downwardAPI"]
            mode = source.get("defaultMode", DEFAULT_FILE_MODE)
            files = _downward_files(pod, source.get("items") or [], mode, allocatable, where)
            contents.append(VolumeContent(name, files=files))
        elif "projected" in volume:
            files = _projected_files(pod, volume["projected"], sources, allocatable, where)
            contents.append(VolumeContent(name, files=files))
        else:
            kinds = sorted(set(volume) - {"name"})
            raise MountError(f"{where}: volume type {kinds} is not supported by the local node agent")
    return contents


def _projected_files(
    pod: dict, projected: dict, sources: Sources, allocatable: dict[str, str], where: str
) -> dict[str, tuple[bytes, int]]:
    mode = projected.get("defaultMode", DEFAULT_FILE_MODE)
    files: dict[str, tuple[bytes, int]] = {}
    for index, source in enumerate(projected.get("sources") or []):
        source_where = f"{where}.projected.sources[{index}]"
        if "configMap" in source:
            configmap = source["configMap"]
            files.update(_object_files("configmap", sources.configmaps, configmap, "name", mode, source_where))
        elif "secret" in source:
            files.update(_object_files("secret", sources.secrets, source["secret"], "name", mode, source_where))
        elif "downwardAPI" in source:
            items = source["downwardAPI"].get("items") or []
            files.update(_downward_files(pod, items, mode, allocatable, source_where))
        elif "serviceAccountToken" in source:
            spec = source["serviceAccountToken"]
            request = token_request(spec)
            if request not in sources.tokens:
                raise MountError(f"{source_where}.serviceAccountToken: no token was issued")
            files[_safe_relative(spec["path"], source_where)] = (sources.tokens[request].encode(), 0o600)
        else:
            raise MountError(f"{source_where}: projection {sorted(source)} is not supported by the local node agent")
    return files
