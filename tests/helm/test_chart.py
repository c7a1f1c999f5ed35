"""The Helm chart without a cluster: strict lint, goldens of `helm template`, values validation,
the copies it carries (CRDs, appVersion), and that its Deployment's command parses with the real CLI.

Goldens live in tests/helm/golden/<case>.yaml. After an intended chart change regenerate them with
`OOBLECK_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/helm/test_chart.py` and review the diff;
a regenerated golden is reported as a skip, never as a silent pass.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from oobleck.cli import build_parser
from oobleck_dev.chart import CHART_PATH, Sync
from oobleck_dev.tools import ToolsNotFound, find_tools

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)


REPO = Path(__file__).resolve().parents[2]
CHART = REPO / CHART_PATH
HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
VALUES = HERE / "values"
UPDATE = os.environ.get("OOBLECK_UPDATE_GOLDEN") == "1"
# `helm template` without a cluster assumes an old Kubernetes; render for the one the tests run.
KUBE_VERSION = "1.36.0"
RELEASE, NAMESPACE = "oobleck", "oobleck-system"
# Case name -> values file (None: the chart's defaults).
CASES = {"default": None, "everything": VALUES / "everything.yaml", "ha-clusterwide": VALUES / "ha-clusterwide.yaml"}


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        tools = find_tools()
    except ToolsNotFound as error:
        pytest.fail(f"cannot test the chart: {error}", pytrace=False)
    if tools.helm is None:
        pytest.fail("helm not found: run scripts/k8s-tools/build", pytrace=False)
    return tools.helm


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def template(
    helm: Path, values: Path | None = None, *extra: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
    if values is not None:
        args += ["--values", str(values)]
    return run_helm(helm, *args, *extra, check=check)


def documents(rendered: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


# -- lint and goldens -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_is_clean_in_strict_mode(helm: Path, case: str) -> None:
    values = CASES[case]
    result = run_helm(helm, "lint", "--strict", str(CHART), *(["--values", str(values)] if values else []), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_template_matches_golden(helm: Path, case: str) -> None:
    rendered = template(helm, CASES[case]).stdout
    golden = GOLDEN / f"{case}.yaml"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(rendered)
        pytest.skip(f"OOBLECK_UPDATE_GOLDEN=1: rewrote {golden.relative_to(REPO)}; review the diff")
    assert golden.is_file(), f"{golden} missing: run with OOBLECK_UPDATE_GOLDEN=1 and review it"
    # Compare text (a changed comment or order is a change to review too), show a short diff.
    if rendered != golden.read_text():
        import difflib

        diff = "".join(
            difflib.unified_diff(
                golden.read_text().splitlines(True), rendered.splitlines(True), "golden", "rendered", n=2
            )
        )
        pytest.fail(
            f"helm template differs from {golden.relative_to(REPO)} (OOBLECK_UPDATE_GOLDEN=1 rewrites it):\n{diff[:6000]}"
        )


# -- what the templates guarantee, whatever the goldens say ---------------------------------------


def test_defaults_are_secure_and_serve_every_namespace(helm: Path) -> None:
    docs = documents(template(helm).stdout)
    (deployment,) = find(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert container["args"][0] == "--all-namespaces"
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two unpeered operators
    # One replica, no peering: no peering CRDs, objects or permissions.
    assert not any(d["kind"] in ("KopfPeering", "ClusterKopfPeering") for d in docs)
    assert not [d for d in find(docs, "CustomResourceDefinition") if d["spec"]["group"] == "kopf.dev"]
    assert "kopf.dev" not in yaml.safe_dump(find(docs, "ClusterRole"))
    # Serving every namespace: the job permissions are bound cluster-wide, no RoleBindings.
    assert {d["metadata"]["name"] for d in find(docs, "ClusterRoleBinding")} == {
        "oobleck-oobleck-operator-cluster",
        "oobleck-oobleck-operator-jobs",
    }
    assert not find(docs, "RoleBinding")
    assert not find(docs, "ServiceMonitor") and not find(docs, "PodMonitor")
    (crd,) = find(docs, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_rendered_crd_is_the_generated_one(helm: Path) -> None:
    """Round-tripping crds/ through the template only adds labels and annotations."""
    (crd,) = find(documents(template(helm).stdout), "CustomResourceDefinition")
    (source,) = documents((REPO / "crds" / "oobleckjobs.oobleck.dev.yaml").read_text())
    assert crd["spec"] == source["spec"]
    assert crd["metadata"]["name"] == source["metadata"]["name"]


def test_namespace_list_binds_roles_per_namespace_and_peers_there(helm: Path) -> None:
    docs = documents(template(helm, CASES["everything"]).stdout)
    bindings = find(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(
        b["roleRef"]
        == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "oobleck-oobleck-operator-jobs"}
        for b in bindings
    )
    assert [b["metadata"]["name"] for b in find(docs, "ClusterRoleBinding")] == ["oobleck-oobleck-operator-cluster"]
    peerings = find(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert all(p["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade" for p in peerings)
    assert {d["metadata"]["name"] for d in find(docs, "CustomResourceDefinition")} == {
        "oobleckjobs.oobleck.dev",
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
    }
    cluster_role = find(docs, "ClusterRole", "oobleck-oobleck-operator-cluster")[0]
    assert {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]} in cluster_role["rules"]
    (deployment,) = find(docs, "Deployment")
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert len(find(docs, "ServiceMonitor")) == 1 and len(find(docs, "PodMonitor")) == 1


def test_clusterwide_peering_uses_the_cluster_peering_object(helm: Path) -> None:
    docs = documents(template(helm, CASES["ha-clusterwide"]).stdout)
    (peering,) = find(docs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "oobleck-operator" and "namespace" not in peering["metadata"]
    cluster_role = find(docs, "ClusterRole", "oobleck-oobleck-operator-cluster")[0]
    assert {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings"],
        "resourceNames": ["oobleck-operator"],
        "verbs": ["patch"],
    } in cluster_role["rules"]
    jobs_role = find(docs, "ClusterRole", "oobleck-oobleck-operator-jobs")[0]
    assert "kopfpeerings" not in yaml.safe_dump(jobs_role)
    assert not [
        d for d in find(docs, "CustomResourceDefinition") if d["spec"]["group"] == "oobleck.dev"
    ]  # crds.install false
    (deployment,) = find(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--peering=oobleck-operator" in args and "--priority=10" in args


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("replicaCount=-1", "/replicaCount"),
        ("operator.watchNamespace=team-a", "watchNamespace"),
        ("operator.watchNamespaces={Team_A}", "/operator/watchNamespaces/0"),
        ("metrics.port=70000", "/metrics/port"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("image.digest=latest", "/image/digest"),
    ],
)
def test_invalid_values_fail_naming_the_field(helm: Path, setting: str, message: str) -> None:
    result = template(helm, None, "--set", setting, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_service_monitor_without_service_is_refused(helm: Path) -> None:
    result = template(
        helm,
        None,
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.service.enabled=false",
        check=False,
    )
    assert result.returncode != 0 and "metrics.serviceMonitor.enabled needs metrics.service.enabled" in result.stderr


# -- copies and contracts -------------------------------------------------------------------------


def test_chart_copies_are_in_step_with_their_sources() -> None:
    """files/crds/ is crds/ byte for byte and appVersion is pyproject's version (oobleck_dev.chart)."""
    assert Sync(REPO).drift() == []


def test_chart_sync_detects_and_repairs_drift(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    for path in ("pyproject.toml", "crds", str(CHART_PATH / "Chart.yaml"), str(CHART_PATH / "files")):
        source, target = REPO / path, root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            import shutil

            shutil.copytree(source, target)
        else:
            target.write_bytes(source.read_bytes())
    sync = Sync(root)
    copy = root / CHART_PATH / "files" / "crds" / "oobleckjobs.oobleck.dev.yaml"
    copy.write_text(copy.read_text() + "# hand edit\n")
    (root / CHART_PATH / "files" / "crds" / "old.yaml").write_text("kind: CustomResourceDefinition\n")
    chart_yaml = root / CHART_PATH / "Chart.yaml"
    chart_yaml.write_text(chart_yaml.read_text().replace('appVersion: "', 'appVersion: "9'))
    problems = sync.drift()
    assert len(problems) == 3, problems
    assert any("differs from crds/oobleckjobs.oobleck.dev.yaml" in p for p in problems)
    assert any("old.yaml: no such CRD" in p for p in problems)
    assert any("appVersion" in p for p in problems)
    sync.write()
    assert sync.drift() == []


def deployment_command(helm: Path, values: Path | None) -> list[str]:
    (deployment,) = find(documents(template(helm, values).stdout), "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return [*container["command"], *container["args"]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_deployment_command_parses_with_the_operator_cli(helm: Path, case: str) -> None:
    """Every flag the chart passes exists in `oobleck operator` (argparse exits 2 on an unknown one)."""
    command = deployment_command(helm, CASES[case])
    assert command[:2] == ["oobleck", "operator"]
    try:
        args = build_parser(command[1]).parse_args(command[1:])
    except SystemExit as error:
        hint = ""
        if any(arg == "--priority=auto" for arg in command):
            # Replicas with equal kopf priorities all pause; one Deployment cannot give each replica
            # its own number, so the operator must derive one (e.g. from POD_ID) when asked.
            hint = "; `--priority auto` (a distinct per-replica priority) must be supported by operator/cli.py"
        pytest.fail(f"`oobleck operator` rejects the chart's arguments {command[2:]} (exit {error.code}){hint}")
    assert args.func is not None and args.metrics_port == 9090 and args.liveness_port == 8080


def test_chart_sync_command_line(tmp_path: Path) -> None:
    import sys

    ok = subprocess.run(
        [sys.executable, "-m", "oobleck_dev.chart", "--check"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    root = tmp_path / "repo"
    (root / CHART_PATH).mkdir(parents=True)
    (root / "crds").mkdir()
    (root / "crds" / "x.yaml").write_text("kind: CustomResourceDefinition\n")
    (root / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "1.2.3"\n')
    (root / CHART_PATH / "Chart.yaml").write_text('apiVersion: v2\nappVersion: "1.0.0"\n')
    stale = subprocess.run(
        [sys.executable, "-m", "oobleck_dev.chart", "--check", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stale.returncode == 1
    assert (
        "files/crds/x.yaml: missing" in stale.stderr
        and "appVersion '1.0.0' != pyproject.toml version '1.2.3'" in stale.stderr
    )
    write = subprocess.run(
        [sys.executable, "-m", "oobleck_dev.chart", "--write", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert write.returncode == 0 and 'appVersion: "1.2.3"' in (root / CHART_PATH / "Chart.yaml").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = subprocess.run(
        [sys.executable, "-m", "oobleck_dev.chart", "--check"], cwd=empty, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "no repository root" in missing.stderr
