"""The worker pod's pure parts: job spec -> WorkerConfig, the env contract, report encodings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from oobleck.api.contract import WORKER_PORT, ExitCode, PodContract
from oobleck.api.reports import FailureReport, ProgressReport
from oobleck.api.spec import parse_spec
from oobleck.runtime.backends.pod.config import PodEnv, config_from_spec
from oobleck.runtime.backends.pod.coordinator_link import coordinator_ip
from oobleck.runtime.backends.pod.report import failure_annotation, progress_annotation
from oobleck.runtime.train.config import build_model
from oobleck.runtime.train.optim import learning_rate

REPO = Path(__file__).parents[2]


def example_spec(**overrides):
    spec = yaml.safe_load((REPO / "examples" / "tiny-gpt.yaml").read_text())["spec"]
    spec.update(overrides)
    return parse_spec(spec)


def test_tiny_gpt_example_maps_to_the_worker_config():
    spec = example_spec()
    config = config_from_spec(spec, "tiny-gpt")
    assert config.job == "tiny-gpt"
    assert config.model.name == "gpt"
    assert config.model.sizes == {"blocks": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256}
    steps = spec.training.steps  # the example's step count changes with the demo; the mapping must not
    assert (config.steps, config.microbatch_size, config.seed, config.device) == (steps, 2, 1234, "cpu")
    assert (config.optim.lr, config.optim.warmup_steps, config.optim.decay_steps) == (0.001, 4, steps)
    assert (config.optim.schedule, config.optim.min_lr_ratio, config.optim.weight_decay) == ("cosine", 0.1, 0.0)
    assert config.data.kind == "synthetic"
    assert config.timeouts.connect == 120.0
    # The model the workers build has the layers the operator's planner planned (blocks + 2).
    assert build_model(config).num_layers == 4 + 2


def test_precision_recompute_clipping_and_sums_map_to_the_worker_config():
    default = config_from_spec(example_spec(), "j")
    assert (default.precision, default.recompute, default.max_grad_norm, default.gradient_sum_dtype) == (
        "fp32",
        "none",
        None,
        "float32",
    )
    training = {"steps": 4, "globalBatchSize": 4, "microbatchSize": 2, "precision": "bf16", "recompute": "full"}
    config = config_from_spec(
        example_spec(training={**training, "maxGradNorm": 1.0, "gradientSumDtype": "float64"}), "j"
    )
    assert (config.precision, config.recompute, config.max_grad_norm, config.gradient_sum_dtype) == (
        "bf16",
        "full",
        1.0,
        "float64",
    )
    for field, value in (
        ("precision", "fp16"),
        ("recompute", "some"),
        ("maxGradNorm", 0),
        ("gradientSumDtype", "half"),
    ):
        with pytest.raises(ValueError, match=field):
            example_spec(training={**training, field: value})


def test_schedules_end_at_a_tenth_of_the_rate_or_stay_constant():
    for schedule, last in (("cosine", 1e-4), ("linear", 1e-4), ("constant", 1e-3)):
        spec = example_spec(
            training={
                "steps": 40,
                "globalBatchSize": 16,
                "microbatchSize": 2,
                "learningRate": 0.001,
                "warmupSteps": 4,
                "schedule": schedule,
            }
        )
        optim = config_from_spec(spec, "j").optim
        assert learning_rate(optim, 3) == pytest.approx(1e-3)  # warmup's last step
        assert learning_rate(optim, 40) == pytest.approx(last)
    linear = config_from_spec(
        example_spec(
            training={
                "steps": 40,
                "globalBatchSize": 16,
                "microbatchSize": 2,
                "learningRate": 0.001,
                "schedule": "linear",
            }
        ),
        "j",
    ).optim
    assert learning_rate(linear, 20) == pytest.approx(0.00055)


def test_token_file_is_read_at_its_container_path():
    spec = example_spec(data={"source": "tokenFile", "path": "/data/train.bin", "claimName": "tokens"})
    config = config_from_spec(spec, "j")
    assert (config.data.kind, config.data.path) == ("file", "/data/train.bin")


def test_checkpoint_spec_maps_to_the_jobs_folder_and_snapshots_stay_on():
    assert config_from_spec(example_spec(), "j").checkpoint.path is None  # no spec.checkpoint: no directory
    spec = example_spec(checkpoint={"path": "/ckpt", "claimName": "c", "intervalSteps": 7, "keep": 3})
    config = config_from_spec(spec, "j")
    # Scoped per job, at the container path the checkpoint volume is mounted at.
    assert (config.checkpoint.path, config.checkpoint.interval_steps, config.checkpoint.keep) == ("/ckpt/j", 7, 3)
    # In-memory snapshots are on by default: a pod gets a snapshot agent (snapshot.snapshotter_for).
    assert config.snapshot.interval_steps > 0


def test_worker_device_runs_a_cuda_spec_on_the_cpu():
    cuda = example_spec(device="cuda")
    assert config_from_spec(cuda, "j").device == "cuda"
    assert config_from_spec(cuda, "j", compute_device="cpu").device == "cpu"
    assert PodEnv.from_env({**ENV, "OOBLECK_DEVICE": "cuda", "WORKER_DEVICE": "cpu"}).compute_device == "cpu"
    assert PodEnv.from_env(ENV).compute_device is None
    with pytest.raises(ValueError, match="WORKER_DEVICE: Input should be 'cpu', got 'tpu'"):
        PodEnv.from_env({**ENV, "WORKER_DEVICE": "tpu"})


def test_progress_annotation_carries_loss_and_throughput_when_known():
    assert json.loads(progress_annotation(2, 17)) == {"generation": 2, "step": 17}
    body = json.loads(progress_annotation(2, 17, 5.123456789, 1234.56789))
    assert body == {"generation": 2, "step": 17, "loss": 5.12346, "samplesPerSecond": 1234.568}
    # A NaN loss is not JSON (json.dumps would write NaN, which the operator's parser rejects): left out.
    assert "loss" not in json.loads(progress_annotation(0, 1, float("nan"), None))
    assert json.loads(progress_annotation(3, 30, checkpoint_step=30))["checkpointStep"] == 30
    # The pace and the calibrated pace it is over (the operator compares nodes running the same layers by both).
    body = json.loads(progress_annotation(3, 30, pace=((29, 1.02), (30, 1.04)), pace_baseline=2.123456789))
    assert body["pace"] == [[29, 1.02], [30, 1.04]] and body["paceBaseline"] == 2.12346
    for odd in (float("nan"), float("inf"), 0.0, -1.0):
        assert "paceBaseline" not in json.loads(progress_annotation(3, 30, pace=((30, 1.0),), pace_baseline=odd))
    for odd in ('"x"', "true", "[1]", "1e999", "1e300", "1e-320"):
        report = ProgressReport.parse(f'{{"generation": 0, "step": 1, "paceBaseline": {odd}}}')
        assert report is not None and report.step == 1 and report.pace_baseline is None
    # Figures out of bounds are dropped one by one: a product or a ratio of two never overflows.
    report = ProgressReport.parse('{"generation": 0, "step": 4, "pace": [[1, 1e-320], [2, 1e300], [3, 1.5], [4, 0]]}')
    assert report is not None and report.pace == ((3, 1.5),)


def test_entry_point_and_unsupported_mlp_width():
    spec = example_spec(model={"entryPoint": "mypkg.models:build"})
    assert config_from_spec(spec, "j").model.name == "mypkg.models:build"
    wide = example_spec(
        model={
            "gpt": {
                "layers": 2,
                "hiddenSize": 64,
                "heads": 4,
                "sequenceLength": 8,
                "vocabSize": 32,
                "ffnHiddenSize": 100,
            }
        }
    )
    with pytest.raises(ValueError, match=r"ffnHiddenSize: the built-in GPT's MLP is 4 \* hiddenSize = 256, got 100"):
        config_from_spec(wide, "j")


ENV = {
    "OOBLECK_JOB": "tiny",
    "OOBLECK_NAMESPACE": "ns",
    "OOBLECK_NODE": "tiny-worker-2",
    "OOBLECK_PLAN_CONFIGMAP": "tiny-plan",
    "OOBLECK_STORE": "tiny-coordinator.tiny-workers.ns.svc:29400",
    "OOBLECK_GPUS_PER_NODE": "2",
    "OOBLECK_DEVICE": "cpu",
    "OOBLECK_POD_IP": "127.16.0.5",
}


def test_env_contract_parses_what_the_operator_renders():
    from oobleck.api import contract
    from oobleck.api.spec import parse_spec as parse
    from oobleck.operator import render

    spec = parse({**example_spec().to_kubernetes(), "gpusPerNode": 2})
    pod = render.worker_pod("tiny", "ns", "uid", spec, 2, default_image="i", default_command=["c"])
    rendered = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    env = PodEnv.from_env({**rendered, "OOBLECK_POD_IP": "127.16.0.5"})  # the kubelet's, from status.podIP
    assert (env.job, env.namespace, env.node, env.plan_config_map) == ("tiny", "ns", "tiny-worker-2", "tiny-plan")
    assert (env.store_port, env.gpus_per_node, env.device, env.pod_ip) == (contract.STORE_PORT, 2, "cpu", "127.16.0.5")
    assert env.coordinator_pod == render.coordinator_name("tiny")
    assert env.metrics_port == WORKER_PORT == contract.WORKER_PORT
    assert PodContract.from_env(rendered).to_env() == [
        e for e in pod["spec"]["containers"][0]["env"] if e["name"] in rendered and e["name"].startswith("OOBLECK_")
    ], "the env round-trips through the contract"


def test_env_errors_name_the_variable():
    with pytest.raises(ValueError, match="OOBLECK_NODE: not set"):
        PodEnv.from_env({k: v for k, v in ENV.items() if k != "OOBLECK_NODE"})
    with pytest.raises(ValueError, match="OOBLECK_STORE: expected HOST:PORT"):
        PodEnv.from_env({**ENV, "OOBLECK_STORE": "nohost"})
    with pytest.raises(ValueError, match="WORKER_DEAD_AFTER_S: Input should be a valid number.*, got 'soon'"):
        PodEnv.from_env({**ENV, "WORKER_DEAD_AFTER_S": "soon"})
    with pytest.raises(ValueError, match="OOBLECK_GPUS_PER_NODE: Input should be greater than or equal to 1, got '0'"):
        PodEnv.from_env({**ENV, "OOBLECK_GPUS_PER_NODE": "0"})
    with pytest.raises(ValueError, match="OOBLECK_DEVICE: Input should be 'cuda' or 'cpu', got 'tpu'"):
        PodEnv.from_env({**ENV, "OOBLECK_DEVICE": "tpu"})
    assert PodEnv.from_env({**ENV, "WORKER_DEAD_AFTER_S": "7.5"}).dead_after_s == 7.5


def test_exit_codes_are_the_contract_s():
    assert [int(code) for code in ExitCode] == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]
    assert (ExitCode.DONE, ExitCode.CONFIG, ExitCode.UNRECOVERABLE) == (0, 2, 5)


def test_failure_annotation_names_plan_nodes():
    report = FailureReport(
        job="tiny",
        generation=3,
        reporter="tiny-worker-0:0",
        kind="heartbeat",
        dead=("tiny-worker-1:0", "tiny-worker-1:1"),
        detail="quiet",
    )
    body = json.loads(failure_annotation(report))
    assert body["dead"] == ["tiny-worker-1"]
    assert (body["job"], body["generation"], body["reporter"], body["kind"]) == (
        "tiny",
        3,
        "tiny-worker-0:0",
        "heartbeat",
    )


def test_coordinator_ip_only_of_a_running_pod():
    running = {"metadata": {}, "status": {"phase": "Running", "podIP": "127.16.0.9"}}
    assert coordinator_ip(running) == "127.16.0.9"
    assert coordinator_ip({"status": {"phase": "Pending", "podIP": "127.16.0.9"}}) is None
    assert coordinator_ip({"metadata": {"deletionTimestamp": "x"}, "status": running["status"]}) is None
    assert coordinator_ip(None) is None


def test_operator_default_command_is_the_pod_entry_point():
    from oobleck.operator.settings import DEFAULT_COMMAND

    assert DEFAULT_COMMAND == ("python", "-m", "oobleck.runtime.backends.pod")


@pytest.mark.integration
def test_supervisor_takes_the_pod_down_with_its_first_failed_gpu_worker():
    import time

    from oobleck.runtime.backends.pod.supervise import supervise

    env = PodEnv.from_env(ENV)  # 2 GPUs per node

    def fail_fast_or_sleep(gpu: int) -> int:  # GPU 0 fails at once with 7; GPU 1 runs a minute unless terminated
        if gpu == 0:
            return 7
        time.sleep(60)
        return 0

    started = time.monotonic()
    assert supervise(env, fail_fast_or_sleep, preload=()) == 7
    assert time.monotonic() - started < 30
    assert supervise(env, lambda gpu: 0, preload=()) == 0  # every child done: the pod is done

    def crash(gpu: int) -> int:
        raise RuntimeError(f"gpu {gpu}")

    assert supervise(env, crash, preload=()) == ExitCode.ERROR  # an exception is the child's failure, not a return


@pytest.mark.integration
def test_supervisor_children_are_forks_that_inherit_the_preload_and_die_with_it(tmp_path):
    """Each GPU's worker is a fork of the supervisor after it imported the preload (no second import of
    torch per GPU), and a SIGKILLed supervisor takes its children with it (PR_SET_PDEATHSIG)."""
    import signal
    import subprocess
    import sys
    import time

    pids = tmp_path / "pids"
    script = f"""
import os, sys, time
from pathlib import Path
from oobleck.runtime.backends.pod.config import PodEnv
from oobleck.runtime.backends.pod.supervise import supervise
env = PodEnv.from_env({ENV!r})
supervisor = os.getpid()

def child(gpu):
    assert os.getppid() == supervisor and "colorsys" in sys.modules  # forked after the preload
    Path({str(pids)!r}, str(gpu)).write_text(str(os.getpid()))
    time.sleep(120)
    return 0

sys.exit(supervise(env, child, preload=("colorsys",)))
"""
    pids.mkdir()
    supervisor = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2 and supervisor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert supervisor.poll() is None and len(list(pids.iterdir())) == 2, "both children started"
        children = [int(p.read_text()) for p in pids.iterdir()]
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(30)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "a child outlived its SIGKILLed supervisor"
    finally:
        supervisor.kill()


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan is reaped by init, a zombie reads state Z)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_gloo_groups_listen_on_the_bound_address():
    """groups.bind_to(pod IP): gloo's pairs listen on that address (pods share a host on local nodes)."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    from oobleck.runtime.train import groups

    address = "127.0.7.3"
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    made: dict[int, object] = {}

    def make(rank: int) -> None:
        client = dist.TCPStore(
            "127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30), wait_for_workers=False
        )
        made[rank] = groups._backend(
            dist.PrefixStore("bind/", client), rank, 2, torch.device("cpu"), datetime.timedelta(seconds=30)
        )

    groups.bind_to(address)
    try:
        threads = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        groups.bind_to(None)
    tensors = [torch.ones(2), torch.full((2,), 2.0)]
    works = [made[rank].allreduce([tensors[rank]]) for rank in (0, 1)]
    for work in works:
        work.wait()
    assert tensors[0].tolist() == [3.0, 3.0]
    # /proc/net/tcp: local addresses as little-endian hex; gloo's connected pairs sit on the bound IP.
    hexed = "".join(f"{int(part):02X}" for part in reversed(address.split(".")))
    with open("/proc/net/tcp") as table:
        local = [line.split()[1].split(":")[0] for line in table.readlines()[1:]]
    assert hexed in local
    groups.GRAVEYARD.append(made)  # gloo groups are never destroyed mid-test (see groups.GRAVEYARD)


def test_two_jobs_sharing_a_checkpoint_path_never_restore_or_prune_each_others_steps(tmp_path):
    """Both jobs' specs name the same volume path; each writes, prunes and restores in its own folder."""
    import torch

    from oobleck.runtime.snapshot.checkpoint_dir import (
        newest_complete_step,
        prune_checkpoints,
        read_checkpoint_layer,
        write_checkpoint_layer,
    )

    spec = example_spec(checkpoint={"path": str(tmp_path), "intervalSteps": 10, "keep": 1})
    first, second = (config_from_spec(spec, job).checkpoint.path for job in ("first", "second"))
    assert first != second
    for step in (10, 20):
        for layer in range(2):
            write_checkpoint_layer(first, step, layer, torch.full((4,), step, dtype=torch.uint8))
    write_checkpoint_layer(second, 30, 0, torch.full((4,), 30, dtype=torch.uint8))
    write_checkpoint_layer(second, 30, 1, torch.full((4,), 30, dtype=torch.uint8))
    prune_checkpoints(second, num_layers=2, keep=1)  # the second job keeps only its own newest step
    assert newest_complete_step(first, 2) == 20 and newest_complete_step(second, 2) == 30
    prune_checkpoints(first, num_layers=2, keep=1)
    assert newest_complete_step(second, 2) == 30 and read_checkpoint_layer(first, 20, 1).tolist() == [20] * 4


@pytest.mark.integration
def test_a_checkpoint_error_on_gpu_1_reaches_gpu_0s_report_through_the_supervisors_folder():
    """Only GPU 0 writes the pod's progress annotation: GPU 1's failed checkpoint write must reach it
    (runtime/backends/pod/siblings.py), across the supervisor's real child processes."""
    import os
    import time

    from oobleck.runtime.backends.pod.siblings import PodSiblings
    from oobleck.runtime.backends.pod.supervise import supervise

    env = PodEnv.from_env(ENV)  # 2 GPUs per node

    def worker(gpu: int) -> int:
        siblings = PodSiblings.from_env(os.environ, gpu, 2)
        assert siblings is not None and oct(os.stat(siblings.folder).st_mode & 0o777) == "0o700"
        if gpu == 1:
            siblings.publish("step 4 in /checkpoints/job: OSError: [Errno 28] No space left on device")
            return 0
        deadline = time.monotonic() + 30
        while (error := siblings.pod_error(None)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert error == "gpu 1: step 4 in /checkpoints/job: OSError: [Errno 28] No space left on device", error
        assert siblings.pod_error("own") == "own"  # GPU 0's own failure comes first
        return 0

    assert supervise(env, worker, preload=()) == 0


def test_siblings_publish_only_changes_read_at_most_every_interval_and_cut_what_they_read(tmp_path):
    from oobleck.runtime.backends.pod.siblings import ERROR_CHARS, READ_INTERVAL_S, PodSiblings

    now = [0.0]
    reporter = PodSiblings(tmp_path, 0, 3, clock=lambda: now[0])
    gpu2 = PodSiblings(tmp_path, 2, 3)
    assert reporter.pod_error(None) is None
    gpu2.publish("x" * 1000)  # a file can hold anything: what is reported is bounded
    assert reporter.pod_error(None) is None  # read again only after the interval
    now[0] += READ_INTERVAL_S
    error = reporter.pod_error(None)
    assert error is not None and error.startswith("gpu 2: x") and len(error) == ERROR_CHARS
    written = (tmp_path / "gpu-2.checkpoint-error").stat().st_mtime_ns
    gpu2.publish("x" * 1000)
    assert (tmp_path / "gpu-2.checkpoint-error").stat().st_mtime_ns == written  # unchanged: not rewritten
    gpu2.publish(None)  # the next write succeeded: the pod's report clears
    now[0] += READ_INTERVAL_S
    assert reporter.pod_error(None) is None
    assert (
        PodSiblings.from_env({}, 0, 2) is None and PodSiblings.from_env({"OOBLECK_POD_SHARED_DIR": "/x"}, 0, 1) is None
    )


def test_a_metrics_port_in_use_is_named_as_such_not_as_a_kubernetes_api_error():
    """A worker whose /metrics port is taken ends with words that name the port and the variable that moves it
    (before, main() reported the OSError as a 'Kubernetes API' transport error)."""
    import socket
    from types import SimpleNamespace

    from oobleck.runtime.backends.pod.main import PodFailure, _announce
    from oobleck.runtime.train.metrics import WorkerMetrics

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        env = PodEnv.from_env({**ENV, "OOBLECK_POD_IP": "127.0.0.1", "WORKER_METRICS_PORT": str(taken - 1)})
        worker = SimpleNamespace(snapshots=None, metrics=WorkerMetrics("tiny", "tiny-worker-2", 1))
        with pytest.raises(PodFailure) as failure:
            _announce(env, 1, worker, config=None, progress=None)  # GPU 1 serves on WORKER_METRICS_PORT + 1
    assert failure.value.code == ExitCode.ERROR
    message = str(failure.value)
    assert f"cannot serve /metrics on 127.0.0.1:{taken}" in message and "WORKER_METRICS_PORT" in message
    assert "Kubernetes" not in message
