"""Print the pip configuration the locally made base image gets: this machine's package index
settings as pip itself reports them (`pip config list`: its files and PIP_* variables, the
variables winning), and the system CA bundle (pip in a virtual environment uses its own otherwise,
which lacks a TLS-intercepting proxy's CA that update-ca-certificates adds)."""

from __future__ import annotations

import subprocess
import sys

KEYS = ("index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout")


def pip_settings() -> dict[str, str]:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    found: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if key not in KEYS:
            continue
        rank = 2 if section == ":env:" else 1 if section == "global" else 0
        key = "timeout" if key == "default-timeout" else key
        if key not in found or rank >= found[key][0]:
            found[key] = (rank, value.strip().strip("'\""))
    return {key: value for key, (_, value) in found.items()}


def pip_conf() -> str:
    lines = ["[global]", "cert = /etc/ssl/certs/ca-certificates.crt"]
    lines += [f"{key} = {value}" for key, value in sorted(pip_settings().items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(pip_conf())
