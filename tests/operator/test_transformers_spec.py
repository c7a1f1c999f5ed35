"""spec.model.transformers from the job to the worker: pod volumes, the worker config, the operator's estimate."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from oobleck.api.schema import MODEL_CONFIG_DIR
from oobleck.api.spec import parse_spec
from oobleck.operator import render
from oobleck.operator.planning import Tuning, synthetic_profile
from oobleck.planner.errors import PlanningError
from oobleck.runtime.backends.pod.config import config_from_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _spec(**model):
    spec = yaml.safe_load((EXAMPLES / "llama-tiny.yaml").read_text())["spec"]
    spec["model"] = {"transformers": model}
    return parse_spec(spec)


def test_config_map_and_init_from_are_mounted_read_only_and_named_in_the_worker_config():
    spec = _spec(
        family="llama",
        configMap={"name": "my-llama", "key": "llama.json"},
        initFrom={"path": "/weights/run1", "claimName": "weights"},
        sequenceLength=16,
    )
    pod = render.worker_pod("j", "ns", "uid", spec, 0, default_image="img", default_command=["x"])
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert mounts["model-config"] == {"name": "model-config", "mountPath": MODEL_CONFIG_DIR, "readOnly": True}
    assert volumes["model-config"]["configMap"] == {
        "name": "my-llama",
        "items": [{"key": "llama.json", "path": "llama.json"}],
    }
    assert mounts["init-from"]["mountPath"] == "/weights/run1" and mounts["init-from"]["readOnly"]
    assert volumes["init-from"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}

    config = config_from_spec(spec, "j")
    hf = config.model.transformers
    assert hf.config_path == f"{MODEL_CONFIG_DIR}/llama.json"
    assert hf.init_from == "/weights/run1"
    assert (hf.family, hf.sequence_length, hf.preset, hf.config) == ("llama", 16, None, None)


def test_preset_and_inline_config_reach_the_worker_and_build():
    from oobleck.runtime.train.config import build_model

    config = config_from_spec(_spec(preset="llama-tiny", sequenceLength=16), "j")
    model = build_model(config)
    assert (model.num_layers, model.seq_len, model.vocab_size) == (6, 16, 256)
    inline = {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 8, "vocab_size": 40}
    config = config_from_spec(_spec(family="gpt2", config=inline), "j")
    model = build_model(config)
    assert (model.num_layers, model.seq_len, model.tied) == (3, 8, True)
    pod = render.worker_pod("j", "ns", "uid", _spec(preset="llama-tiny"), 0, default_image="i", default_command=["x"])
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"dshm", "job-key"}


def test_the_operator_estimates_presets_and_inline_configs_but_not_config_maps():
    profile = synthetic_profile(_spec(preset="gpt3-2.7b"), Tuning())
    assert len(profile.layers) == 34 and profile.model == "gpt3-2.7b"
    llama = synthetic_profile(_spec(preset="llama-tiny"), Tuning())
    assert len(llama.layers) == 6
    inline = synthetic_profile(_spec(family="llama", config={"num_hidden_layers": 3, "hidden_size": 32}), Tuning())
    assert len(inline.layers) == 5
    with pytest.raises(PlanningError, match="model.transformers.configMap"):
        synthetic_profile(_spec(family="llama", configMap={"name": "c"}), Tuning())
