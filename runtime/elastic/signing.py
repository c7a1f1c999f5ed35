"""Authenticating what a worker acts on: HMAC-SHA256 under the job's key.

Anyone on the pod network can reach the coordinator's store and a worker's snapshot server; only the
job's pods hold the key (a file named by $OOBLECK_JOB_KEY_FILE: a mounted Secret in a pod, a 0600 file
in `oobleck launch`'s workdir). A store value is sealed as `oobleck-mac1:<hex mac>:<value>`, the MAC
binding the store key too (a value copied under another key does not verify). A value that does not
verify is refused: counted per kind, logged once per kind, never acted on.

Without a key (workers built by hand in tests) values are stored and read as they are.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger(__name__)

KEY_FILE_ENV = "OOBLECK_JOB_KEY_FILE"
_PREFIX = b"oobleck-mac1:"
_MAC_HEX = 64
KEY_BYTES = 32


class Rejected(ValueError):
    """A message without a valid MAC under the job's key."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind}: {why}")
        self.kind = kind


class Signer:
    """Seals and opens values under one job key (or passes them through when `key` is None)."""

    def __init__(self, key: bytes | None) -> None:
        if key is not None and len(key) < 16:
            raise ValueError(f"job key: {len(key)} bytes, at least 16 needed")
        self.key = key
        self._lock = threading.Lock()
        self.rejected: dict[str, int] = {}
        """refused messages by kind (also handed to every listener); a store value read again is one message"""
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._listeners: list[Callable[[str], None]] = []

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def mac(self, name: str, value: bytes) -> str:
        assert self.key is not None
        return hmac.new(self.key, name.encode() + b"\0" + value, hashlib.sha256).hexdigest()

    def seal(self, name: str, value: str | bytes) -> str | bytes:
        """`value` as stored under store key `name`."""
        if self.key is None:
            return value
        raw = value.encode() if isinstance(value, str) else value
        sealed = _PREFIX + self.mac(name, raw).encode() + b":" + raw
        return sealed.decode() if isinstance(value, str) else sealed

    def open(self, name: str, stored: bytes | str, kind: str) -> bytes:
        """The value sealed under `name`; raises Rejected (after counting it) if its MAC does not verify."""
        raw = stored.encode() if isinstance(stored, str) else bytes(stored)
        if self.key is None:
            return raw
        head = len(_PREFIX) + _MAC_HEX
        if not raw.startswith(_PREFIX) or raw[head : head + 1] != b":":
            raise self.reject(kind, f"{name}: no MAC", name.encode() + b"\0" + raw)
        value = raw[head + 1 :]
        if not hmac.compare_digest(raw[len(_PREFIX) : head], self.mac(name, value).encode()):
            raise self.reject(kind, f"{name}: bad MAC", name.encode() + b"\0" + raw)
        return value

    def verified(self, name: str, stored: bytes | str, kind: str) -> bytes | None:
        """`open`, or None for a refused value."""
        try:
            return self.open(name, stored, kind)
        except Rejected:
            return None

    def open_json(self, name: str, stored: bytes | str, kind: str):
        """The JSON value sealed under `name`, or None for a refused one."""
        value = self.verified(name, stored, kind)
        return None if value is None else json.loads(value)

    def reject(self, kind: str, why: str, message: bytes | None = None) -> Rejected:
        """`count_rejected`, returning the error to raise."""
        self.count_rejected(kind, why, message)
        return Rejected(kind, why)

    def count_rejected(self, kind: str, why: str, message: bytes | None = None) -> None:
        """Count and (once per kind) log a refused message. `message`: its bytes, when the same message may be
        met again (a forged store value is read on every poll): it then counts once (among the last 256)."""
        with self._lock:
            if message is not None:
                seen = (kind, hashlib.sha256(message).digest())
                if seen in self._seen:
                    return
                self._seen[seen] = None
                if len(self._seen) > 256:
                    self._seen.popitem(last=False)
            first = kind not in self.rejected
            self.rejected[kind] = self.rejected.get(kind, 0) + 1
            listeners = list(self._listeners)
        if first:
            log.warning(json.dumps({"event": "message-rejected", "kind": kind, "why": why[:200]}))
        for listener in listeners:
            listener(kind)

    def on_reject(self, listener: Callable[[str], None]) -> None:
        """Call `listener(kind)` for every refused message from now on (the worker's metric)."""
        with self._lock:
            self._listeners.append(listener)


NO_KEY = Signer(None)


def load_key(path: str) -> bytes:
    """The job key in the file at `path` (a Secret's value or `write_key`'s file), surrounding whitespace dropped."""
    try:
        with open(path, "rb") as file:
            key = file.read().strip()
    except OSError as error:
        raise ValueError(f"{KEY_FILE_ENV}={path}: cannot read the job key: {error}") from error
    if len(key) < 16:
        raise ValueError(f"{KEY_FILE_ENV}={path}: the job key has {len(key)} bytes, at least 16 needed")
    return key


def write_key(path: str) -> bytes:
    """Create a fresh random job key at `path`, readable by its owner only (0600); returns it."""
    key = secrets.token_hex(KEY_BYTES).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(key)
    os.chmod(path, 0o600)
    return key


@functools.lru_cache(maxsize=8)
def _signer_for(path: str) -> Signer:
    return Signer(load_key(path))


def job_signer() -> Signer:
    """This process's signer: the key in $OOBLECK_JOB_KEY_FILE, else none (one Signer per key file, so
    every component of a worker counts its refusals in one place)."""
    path = os.environ.get(KEY_FILE_ENV)
    return _signer_for(path) if path else NO_KEY
