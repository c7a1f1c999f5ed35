"""The e2e reference cache is keyed by the sources the reference run imports (oobleck_dev.references.REFERENCE_SOURCES): a
reference run in a fresh interpreter imports no module of the project outside them. Were one added (say the
trainer came to import the elastic loop), an edit there could change the losses while a stale cached
reference stood; this test names the module to add."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oobleck.api.spec import parse_spec
from oobleck.runtime.backends.pod.config import config_from_spec
from oobleck.runtime.train.reference import train_reference

pytestmark = pytest.mark.integration  # starts a process; trains references

SCRIPT = """
import json, sys
from oobleck.api.spec import parse_spec
from oobleck.runtime.backends.pod.config import config_from_spec
from oobleck.runtime.train.reference import train_reference

parsed = parse_spec(json.loads(sys.argv[1]))
config = config_from_spec(parsed, "tiny", compute_device="cpu")
train_reference(config, parsed.training.global_microbatches, 2)
files = [m.__file__ for name, m in list(sys.modules.items()) if name.startswith("oobleck") and getattr(m, "__file__", None)]
print(json.dumps(files))
"""


def test_the_reference_run_imports_nothing_of_the_project_outside_its_keyed_sources(reference_keying):
    spec, repo, sources = reference_keying
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(spec)], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    files = [os.path.relpath(os.path.realpath(f), repo) for f in json.loads(out.splitlines()[-1])]
    assert any(f.startswith("runtime/train/") for f in files), files  # the files are the repository's
    outside = [f for f in files if not any(f == s or f.startswith(f"{s}/") for s in sources)]
    assert outside == [], f"the reference run imports {outside}: add them to REFERENCE_SOURCES"


def test_a_longer_reference_trains_on_from_the_kept_state(reference_keying, empty_reference_cache, tmp_path):
    spec = {**reference_keying[0], "training": {**reference_keying[0]["training"], "steps": 40}}
    head = empty_reference_cache(spec, through=10)
    (kept,) = tmp_path.glob("*.json")
    assert len(json.loads(kept.read_text())) == 10 and kept.with_suffix(".pt").exists()
    # Marked kept losses come back only if the longer reference went on from them rather than from step 0.
    kept.write_text(json.dumps([-1.0] * 10))
    longer = empty_reference_cache(spec, through=25)
    assert longer[:10] == (-1.0,) * 10 and len(json.loads(kept.read_text())) == 25
    parsed = parse_spec(spec)
    config = config_from_spec(parsed, "tiny", compute_device="cpu")
    whole = train_reference(config, parsed.training.global_microbatches, 25).losses
    assert head == tuple(whole[:10]) and longer[10:] == tuple(whole[10:])
