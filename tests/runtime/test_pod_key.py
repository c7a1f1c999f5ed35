"""The pod's job key: OOBLECK_JOB_KEY_FILE (a mounted Secret) read at its path, a bad key a configuration
error naming the variable."""

from __future__ import annotations

import os

import pytest

from oobleck.api.contract import ExitCode
from oobleck.runtime.backends.pod.config import PodEnv
from oobleck.runtime.backends.pod.main import main, use_job_key
from oobleck.runtime.elastic.signing import KEY_FILE_ENV, job_signer

ENV = {
    "OOBLECK_JOB": "tiny",
    "OOBLECK_NAMESPACE": "ns",
    "OOBLECK_NODE": "tiny-worker-2",
    "OOBLECK_PLAN_CONFIGMAP": "tiny-plan",
    "OOBLECK_STORE": "tiny-coordinator.tiny-workers.ns.svc:29400",
    "OOBLECK_DEVICE": "cpu",
}


def test_the_key_is_read_at_its_path(tmp_path, monkeypatch):
    (tmp_path / "key").write_bytes(b"s" * 40 + b"\n")
    env = PodEnv.from_env({**ENV, "OOBLECK_JOB_KEY_FILE": str(tmp_path / "key")})
    use_job_key(env)
    assert os.environ[KEY_FILE_ENV] == str(tmp_path / "key")
    assert job_signer().key == b"s" * 40
    with pytest.raises(ValueError, match=f"{KEY_FILE_ENV}: not set"):
        use_job_key(PodEnv.from_env(ENV))  # a pod never runs unauthenticated


def test_an_unreadable_key_is_a_configuration_error(tmp_path, monkeypatch, capsys):
    for name, value in {**ENV, "OOBLECK_JOB_KEY_FILE": str(tmp_path / "absent")}.items():
        monkeypatch.setenv(name, value)
    assert main([]) == ExitCode.CONFIG
    assert f"{KEY_FILE_ENV}={tmp_path / 'absent'}: cannot read the job key" in capsys.readouterr().err
    (tmp_path / "short").write_bytes(b"short")
    monkeypatch.setenv("OOBLECK_JOB_KEY_FILE", str(tmp_path / "short"))
    assert main([]) == ExitCode.CONFIG
    assert "at least 16 needed" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _keep_the_environment(monkeypatch):
    # use_job_key sets the variable itself; setenv first so that monkeypatch records it and takes it away
    # again (a delenv of an absent variable records nothing).
    monkeypatch.setenv(KEY_FILE_ENV, "unset")
    monkeypatch.delenv(KEY_FILE_ENV)
