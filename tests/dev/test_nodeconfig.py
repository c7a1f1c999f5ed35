"""The real nodes' configuration renderings (pure) and the pause image archive."""

from __future__ import annotations

import io
import json
import tarfile
import tomllib
from pathlib import Path

import pytest

from oobleck_dev.imagestore import pause_archive
from oobleck_dev.nodeconfig import NodeLayout, cni_conflist, containerd_config, kubelet_args, kubelet_config


def test_two_nodes_share_no_path_address_or_bridge(tmp_path):
    first, second = NodeLayout(1, tmp_path / "node-1"), NodeLayout(2, tmp_path / "node-2")
    configs = [tomllib.loads(containerd_config(node, "localhost/pause:1")) for node in (first, second)]
    for config, node in zip(configs, (first, second)):
        cri = config["plugins"]["io.containerd.grpc.v1.cri"]
        assert config["root"] == str(node.containerd_root) and config["grpc"]["address"] == str(node.socket)
        # Without this every sandbox fails on a host without CAP_SYS_RESOURCE.
        assert cri["restrict_oom_score_adj"] is True and cri["netns_mounts_under_state_dir"] is True
        assert cri["cni"]["conf_dir"] == str(node.cni_dir)
        assert cri["containerd"]["runtimes"]["runc"]["options"] == {"SystemdCgroup": False, "Root": str(node.runc_root)}
    assert {c["root"] for c in configs} | {c["state"] for c in configs} == {
        str(first.containerd_root),
        str(second.containerd_root),
        str(first.containerd_state),
        str(second.containerd_state),
    }
    networks = [json.loads(cni_conflist(node))["plugins"][0] for node in (first, second)]
    assert [n["bridge"] for n in networks] == ["oobk1", "oobk2"]
    assert [n["ipam"]["ranges"][0][0]["subnet"] for n in networks] == ["10.244.1.0/24", "10.244.2.0/24"]
    kubelets = [kubelet_config(node, Path("/ca"), Path("/c"), Path("/k")) for node in (first, second)]
    assert [k["address"] for k in kubelets] == ["10.244.1.1", "10.244.2.1"]
    assert [k["cgroupRoot"] for k in kubelets] == ["/oobleck-real-1", "/oobleck-real-2"]
    assert all(k["failCgroupV1"] is False and k["authorization"]["mode"] == "Webhook" for k in kubelets)
    assert "--node-ip=10.244.2.1" in kubelet_args(second, Path("/c"), Path("/k"))


def test_a_node_index_out_of_range_is_refused(tmp_path):
    with pytest.raises(ValueError, match="index"):
        NodeLayout(0, tmp_path)


def test_the_pause_archive_is_a_docker_archive_of_one_layer(tmp_path):
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF not really")
    with tarfile.open(fileobj=io.BytesIO(pause_archive(binary, "localhost/pause:1"))) as archive:
        manifest = json.loads(archive.extractfile("manifest.json").read())
        assert manifest[0]["RepoTags"] == ["localhost/pause:1"]
        config = json.loads(archive.extractfile(manifest[0]["Config"]).read())
        assert config["config"]["Entrypoint"] == ["/pause"]
        layer = tarfile.open(fileobj=io.BytesIO(archive.extractfile(manifest[0]["Layers"][0]).read()))
        member = layer.getmember("pause")
        assert member.mode == 0o755 and layer.extractfile(member).read() == binary.read_bytes()
