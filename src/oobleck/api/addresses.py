"""Identities and addresses as text, formatted and parsed here only: a worker's `node:gpu` and a `HOST:PORT`."""

from __future__ import annotations


def worker_id(node: str, gpu: int) -> str:
    """A worker's identity across generations (its rank may change, its place does not)."""
    return f"{node}:{gpu}"


def parse_worker_id(text: str) -> tuple[str, int]:
    """(node, gpu) of a `worker_id`; node names may hold colons, the GPU index is after the last one."""
    node, sep, gpu = text.rpartition(":")
    if not sep or not node or not gpu.isdigit():
        raise ValueError(f"expected NODE:GPU, got {text!r}")
    return node, int(gpu)


def host_port(host: str, port: int) -> str:
    """`HOST:PORT`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_host_port(text: str) -> tuple[str, int]:
    """(host, port) of `HOST:PORT` (`[V6]:PORT` too); a ValueError names what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)
