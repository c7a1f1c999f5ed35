"""The OobleckJob pydantic models and condition helpers, without a cluster."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from oobleck.api import model_spec, pod_spec, resource, spec, status
from oobleck.api.conditions import ConditionType, Reason, find_condition, phase_of, set_condition
from oobleck.api.schema import CrdModel
from oobleck.api.spec import OobleckJobSpec, parse_spec
from oobleck.api.status import OobleckJobStatus, Phase, parse_status

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MINIMAL = {
    "model": {"gpt": {"layers": 2, "hiddenSize": 32, "heads": 2, "sequenceLength": 16, "vocabSize": 64}},
    "nodes": {"min": 2, "max": 3},
    "training": {"steps": 5, "globalBatchSize": 8, "microbatchSize": 2},
}


def test_minimal_spec_gets_the_documented_defaults() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.f == 1
    assert spec.gpus_per_node == 1
    assert spec.gpu_resource_name == "nvidia.com/gpu"
    assert spec.device == "cuda"
    assert spec.nodes.target is None and spec.nodes.wanted == 3
    assert spec.data.source == "synthetic"
    assert spec.profile.source == "measure"
    assert spec.checkpoint is None
    assert spec.clean_pod_policy == "Running"
    assert spec.pending_timeout_seconds == 300
    assert (spec.resources.cpu, spec.resources.memory) == ("1", "2Gi")
    assert spec.training.learning_rate == pytest.approx(3e-4)
    assert spec.training.global_microbatches == 4


def test_kubernetes_and_python_names_are_both_accepted_and_dumps_use_kubernetes_names() -> None:
    by_python_name = parse_spec(
        {**MINIMAL, "gpus_per_node": 2, "training": {"steps": 5, "global_batch_size": 8, "microbatch_size": 2}}
    )
    by_kubernetes_name = parse_spec({**MINIMAL, "gpusPerNode": 2})
    assert by_python_name == by_kubernetes_name
    dumped = by_kubernetes_name.to_kubernetes()
    assert dumped["gpusPerNode"] == 2
    assert dumped["training"]["globalBatchSize"] == 8
    assert "gpus_per_node" not in dumped and "checkpoint" not in dumped  # unset optionals are left out


def test_example_round_trips(example: dict[str, Any]) -> None:
    spec = parse_spec(example["spec"])
    assert spec.model.gpt is not None and spec.model.gpt.layers == 4
    assert spec.device == "cpu" and spec.nodes.wanted == 4
    again = parse_spec(spec.to_kubernetes())
    assert again == spec
    assert OobleckJobSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_a_valid_job(path: Path) -> None:
    document = yaml.safe_load(path.read_text())
    assert (document["apiVersion"], document["kind"]) == (resource.API_VERSION, resource.KIND)
    assert len(document["metadata"]["name"]) <= resource.MAX_NAME_LENGTH
    spec = parse_spec(document["spec"])
    assert parse_spec(spec.to_kubernetes()) == spec


def test_quantities_accept_numbers_and_strings() -> None:
    spec = parse_spec({**MINIMAL, "resources": {"cpu": 2, "memory": "512Mi"}})
    assert spec.resources.cpu == 2 and spec.resources.memory == "512Mi"
    for good in ("500m", "1.5", "8Gi", "1e3", ".5"):
        assert parse_spec({**MINIMAL, "resources": {"cpu": good}}).resources.cpu == good


def test_models_are_frozen() -> None:
    spec = parse_spec(MINIMAL)
    with pytest.raises(ValidationError):
        spec.f = 3  # type: ignore[misc]


def _errors(spec: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as caught:
        parse_spec(spec)
    return [(".".join(str(part) for part in error["loc"]), error["msg"]) for error in caught.value.errors()]


def test_invalid_specs_are_rejected_naming_the_field(invalid_spec_case: dict[str, Any]) -> None:
    expected = invalid_spec_case["pydantic"]
    errors = _errors(invalid_spec_case["manifest"]["spec"])
    assert any(loc == expected["loc"] and expected["message"] in msg for loc, msg in errors), errors


def test_every_rule_names_a_field_of_its_model() -> None:
    # A CEL fieldPath that names no field makes the API server refuse the whole CRD.
    models = [
        m
        for module in (model_spec, pod_spec, spec, status)
        for m in vars(module).values()
        if isinstance(m, type) and issubclass(m, CrdModel)
    ]
    checked = 0
    for model in models:
        aliases = {field.alias or name for name, field in model.model_fields.items()}
        for rule in model._RULES:
            if rule.field_path is None:
                continue
            first = rule.field_path.lstrip(".").split(".")[0]
            assert first in aliases, f"{model.__name__}: fieldPath {rule.field_path} is not one of {sorted(aliases)}"
            checked += 1
    assert checked >= 10


def test_python_messages_show_the_arithmetic() -> None:
    errors = _errors({**MINIMAL, "training": {"steps": 5, "globalBatchSize": 10, "microbatchSize": 4}})
    assert (
        "training",
        "Value error, globalBatchSize (10) must be a multiple of microbatchSize (4): remainder 2",
    ) in errors


def test_status_round_trips_with_kubernetes_timestamps() -> None:
    status = parse_status(
        {
            "phase": "Running",
            "observedGeneration": 3,
            "nodes": 4,
            "selector": "oobleck.dev/job=tiny-gpt",
            "conditions": [
                {
                    "type": "Running",
                    "status": "True",
                    "reason": "Training",
                    "message": "",
                    "lastTransitionTime": "2026-01-02T03:04:05Z",
                }
            ],
            "plan": {"generation": 2, "pipelines": 2, "nodes": 4, "templates": [{"nodes": 2, "pipelines": 2}]},
            "progress": {"step": 17, "samplesPerSecond": 250.5},
            "failuresSurvived": 1,
            "reconfigurations": 1,
        }
    )
    assert status.phase is Phase.RUNNING
    assert status.conditions[0].last_transition_time == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    dumped = status.to_kubernetes()
    assert dumped["conditions"][0]["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    assert dumped["plan"]["templates"] == [{"nodes": 2, "pipelines": 2}]
    assert parse_status(dumped) == status
    assert parse_status(None) == OobleckJobStatus()


def test_condition_status_must_be_true_false_or_unknown() -> None:
    with pytest.raises(ValidationError) as caught:
        parse_status(
            {
                "conditions": [
                    {
                        "type": "Running",
                        "status": "Yes",
                        "reason": "Training",
                        "lastTransitionTime": "2026-01-02T03:04:05Z",
                    }
                ]
            }
        )
    assert caught.value.errors()[0]["loc"] == ("conditions", 0, "status")


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_set_condition_adds_then_keeps_transition_time_while_status_holds() -> None:
    first = set_condition([], ConditionType.RUNNING, "True", Reason.TRAINING, "step 1", 1, T0)
    assert [c.type for c in first] == ["Running"] and first[0].last_transition_time == T0
    later = set_condition(first, ConditionType.RUNNING, "True", Reason.TRAINING, "step 9", 2, T0 + timedelta(minutes=5))
    running = find_condition(later, ConditionType.RUNNING)
    assert running is not None
    assert running.last_transition_time == T0  # unchanged status: the transition time stays
    assert (running.message, running.observed_generation) == ("step 9", 2)
    assert first[0].message == "step 1"  # the input list is not modified


def test_set_condition_moves_transition_time_on_a_change_and_keeps_order() -> None:
    conditions = set_condition([], ConditionType.CREATED, "True", Reason.OBJECTS_CREATED, "", 1, T0)
    conditions = set_condition(conditions, ConditionType.RUNNING, "True", Reason.TRAINING, "", 1, T0)
    t1 = T0 + timedelta(seconds=30, microseconds=123)
    conditions = set_condition(conditions, ConditionType.RUNNING, "False", Reason.NOT_APPLICABLE, "", 1, t1)
    assert [c.type for c in conditions] == ["Created", "Running"]
    assert conditions[1].status == "False"
    assert conditions[1].last_transition_time == t1.replace(microsecond=0)  # metav1.Time has seconds


def test_phase_follows_the_conditions() -> None:
    conditions = set_condition([], ConditionType.CREATED, "True", Reason.OBJECTS_CREATED, "", 1, T0)
    assert phase_of(conditions) is Phase.PENDING
    conditions = set_condition(conditions, ConditionType.RUNNING, "True", Reason.TRAINING, "", 1, T0)
    assert phase_of(conditions) is Phase.RUNNING
    conditions = set_condition(conditions, ConditionType.RECONFIGURING, "True", Reason.NODE_LOST, "", 1, T0)
    assert phase_of(conditions) is Phase.RECONFIGURING
    conditions = set_condition(conditions, ConditionType.FAILED, "True", Reason.LAYERS_LOST, "", 1, T0)
    assert phase_of(conditions) is Phase.FAILED
