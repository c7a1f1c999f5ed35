"""The pure parts of oobleck.dev: tool lookup order, certificates, fake nodes, kubeconfigs."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from oobleck_dev import kwok, tools
from oobleck_dev.certs import CertificateAuthority, service_account_keys
from oobleck_dev.controlplane import Cluster, kubeconfig_yaml, server_of


def fake_bin(folder: Path, names: tuple[str, ...]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = folder / name
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    return folder


def test_kubebuilder_assets_come_first_and_the_rest_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    cache = fake_bin(tmp_path / "cache" / "bin", tools.REQUIRED + tools.OPTIONAL)
    (tmp_path / "cache" / "kwok-stages").mkdir()
    monkeypatch.setattr(tools, "cache_bin_dir", lambda build=False: cache)
    # envtest's assets hold only these three.
    assets = fake_bin(tmp_path / "assets", ("etcd", "kube-apiserver", "kubectl"))
    found = tools.find_tools(env={"KUBEBUILDER_ASSETS": str(assets), "PATH": ""})
    assert found.kube_apiserver == assets / "kube-apiserver" and found.sources["kubectl"] == "KUBEBUILDER_ASSETS"
    assert found.kube_scheduler == cache / "kube-scheduler" and found.sources["kube-scheduler"] == "cache"
    assert found.kwok_stages == tmp_path / "cache" / "kwok-stages"


def test_path_is_used_only_when_asked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tools, "cache_bin_dir", lambda build=False: None)
    on_path = fake_bin(tmp_path / "path", tools.REQUIRED)
    with pytest.raises(tools.ToolsNotFound, match="OOBLECK_K8S_TOOLS_FROM_PATH=1") as error:
        tools.find_tools(env={"PATH": str(on_path)})
    assert "etcd" in str(error.value) and "scripts/k8s-tools/build" in str(error.value)
    found = tools.find_tools(env={"PATH": str(on_path), "OOBLECK_K8S_TOOLS_FROM_PATH": "1"})
    assert found.kubectl == on_path / "kubectl" and set(found.sources.values()) == {"PATH"}
    assert found.kwok is None
    with pytest.raises(tools.ToolsNotFound, match="kwok"):
        found.require_kwok()


def test_certificates_chain_to_the_ca_with_the_right_names_and_usages(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    pair = ca.issue("api", "kube-apiserver", server=True, hosts=("127.0.0.1", "kubernetes.default"))
    client = ca.issue("admin", "oobleck-admin", organizations=("system:masters",), client=True)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    server_cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
    client_cert = x509.load_pem_x509_certificate(client.cert.read_bytes())
    for cert in (server_cert, client_cert):
        cert.verify_directly_issued_by(ca_cert)
        assert cert.not_valid_before_utc <= datetime.datetime.now(datetime.UTC) <= cert.not_valid_after_utc
    names = server_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["kubernetes.default"]
    usages = client_cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    # Kubernetes reads the user from CN and the groups from O.
    assert client_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    assert oct(pair.key.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ValueError, match="server, a client, or both"):
        ca.issue("nothing", "nothing")
    keys = service_account_keys(tmp_path)
    serialization.load_pem_public_key(keys.cert.read_bytes())


def test_fake_node_has_gpu_capacity_and_the_kwok_label() -> None:
    node = kwok.fake_node("n0", gpus=4, labels={"team": "a"})
    assert node["status"]["capacity"][kwok.GPU_RESOURCE] == "4"
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert node["metadata"]["labels"][kwok.FAKE_NODE_LABEL] == kwok.FAKE_NODE_VALUE
    assert node["metadata"]["labels"]["team"] == "a"
    with pytest.raises(ValueError, match="gpus"):
        kwok.fake_node("n0", gpus=-1)


def test_a_fake_node_registered_not_ready_is_tainted_until_kwok_reports_it_ready() -> None:
    node = kwok.fake_node("n0", gpus=1, taints=[{"key": "team", "effect": "NoSchedule"}], not_ready=True)
    assert node["spec"]["taints"] == [{"key": "team", "effect": "NoSchedule"}, kwok.NOT_READY_TAINT]
    (ready,) = node["status"]["conditions"]
    assert (ready["type"], ready["status"]) == ("Ready", "False")  # what kwok's node-initialize stage selects
    assert "conditions" not in kwok.fake_node("n1", gpus=1)["status"]


def test_add_fake_nodes_validates_before_calling_the_api() -> None:
    with pytest.raises(ValueError, match="owner"):
        kwok.add_fake_nodes("/nonexistent", 1, owner="Not_A_Label")
    with pytest.raises(ValueError, match="^n:"):
        kwok.add_fake_nodes("/nonexistent", -1)


def test_kwok_runs_the_fast_and_lease_stages(tmp_path: Path) -> None:
    stages = tmp_path / "stages"
    for folder in kwok.STAGE_FOLDERS:
        (stages / folder).mkdir(parents=True)
        (stages / folder / "kustomization.yaml").write_text("{}")
        (stages / folder / f"{folder.replace('/', '-')}.yaml").write_text("{}")
    files = kwok.stage_files(stages)
    assert [f.name for f in files] == ["node-fast.yaml", "node-heartbeat-with-lease.yaml", "pod-fast.yaml"]
    (stages / "pod" / "fast" / "pod-fast.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="pod/fast"):
        kwok.stage_files(stages)


def test_kubeconfig_round_trip(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path)
    admin = ca.issue("admin", "admin", client=True)
    text = kubeconfig_yaml("https://127.0.0.1:6443", ca.cert, admin, "admin", embed=True)
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    assert server_of(path) == "https://127.0.0.1:6443"
    assert "client-key-data" in yaml.safe_load(text)["users"][0]["user"]
    path.write_text(yaml.safe_dump({"current-context": "gone", "contexts": [], "clusters": []}))
    with pytest.raises(ValueError, match="current-context 'gone'"):
        server_of(path)


def test_namespace_prefix_is_validated(tmp_path: Path) -> None:
    handle = Cluster(kubeconfig=os.devnull, server="https://127.0.0.1:1", bin=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name_prefix"):
        handle.namespace("Bad_Prefix")
