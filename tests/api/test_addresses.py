"""Worker ids and HOST:PORT: formatted and parsed in one place (oobleck.api.addresses)."""

from __future__ import annotations

import pytest

from oobleck.api.addresses import host_port, parse_host_port, parse_worker_id, worker_id


def test_a_worker_id_round_trips_even_when_the_node_name_has_colons():
    assert worker_id("tiny-worker-3", 1) == "tiny-worker-3:1"
    assert parse_worker_id(worker_id("tiny-worker-3", 1)) == ("tiny-worker-3", 1)
    assert parse_worker_id("a:b:7") == ("a:b", 7)


@pytest.mark.parametrize("text", ["", "node", "node:", ":0", "node:x", "node:-1"])
def test_a_malformed_worker_id_names_the_expected_form(text):
    with pytest.raises(ValueError, match="expected NODE:GPU"):
        parse_worker_id(text)


def test_host_port_round_trips_ipv4_names_and_ipv6():
    for host, port in (("10.1.2.3", 29400), ("tiny-coordinator.ns.svc", 1), ("::1", 65535)):
        assert parse_host_port(host_port(host, port)) == (host, port)
    assert host_port("::1", 80) == "[::1]:80"


@pytest.mark.parametrize("text", ["", "host", "host:", ":80", "host:http", "host:0", "host:65536"])
def test_a_malformed_address_names_the_expected_form(text):
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_host_port(text)
