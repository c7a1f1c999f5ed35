"""The runtime's use of the official Kubernetes client without a cluster: in-pod configuration and
error messages. The watch (resume, relist) runs against a real API server in test_kube_cluster.py."""

from __future__ import annotations

import pytest
from kubernetes.client import ApiException

from oobleck.runtime.backends.pod.kube import Kube, KubeConfigError, api_error_text


def test_in_cluster_config_reads_the_serviceaccount_folder(tmp_path):
    (tmp_path / "token").write_text("abc\n")
    (tmp_path / "ca.crt").write_text("---")
    (tmp_path / "namespace").write_text("team-a")
    kube = Kube.in_cluster({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}, str(tmp_path))
    configuration = kube.core.api_client.configuration
    assert kube.namespace == "team-a"
    assert configuration.host == "https://[fd00::1]:6443"
    assert configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert configuration.api_key["BearerToken"].strip() == "bearer abc"
    # Projected tokens rotate: the client re-reads the file (after its refresh period).
    assert configuration.refresh_api_key_hook is not None


def test_in_cluster_config_names_what_is_missing(tmp_path):
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        Kube.in_cluster({}, str(tmp_path))
    with pytest.raises(KubeConfigError, match="token: missing"):
        Kube.in_cluster({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, str(tmp_path))
    (tmp_path / "token").write_text("abc")
    with pytest.raises(KubeConfigError, match="ca.crt: missing"):
        Kube.in_cluster({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, str(tmp_path))


def test_api_errors_read_as_status_reason_and_message():
    error = ApiException(status=403, reason="Forbidden")
    error.body = '{"kind":"Status","status":"Failure","message":"pods \\"x\\" is forbidden: no","code":403}'
    assert api_error_text(error) == '403 Forbidden: pods "x" is forbidden: no'
    garbled = ApiException(status=500, reason="Internal Server Error")
    garbled.body = "not json at all"
    assert api_error_text(garbled) == "500 Internal Server Error: not json at all"
