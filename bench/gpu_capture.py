"""Where a GPU snapshot's time goes: the capture's pieces on one GPU, beside a step's worth of GPU work.

The state is the bench model's real layers with their AdamW state (`capture_layers`, what a snapshot runs).
Printed, in seconds:
- `pin`: allocating page-locked host buffers for the whole state (`PinnedBuffers.prepare`);
- `capture`: one capture alone into prepared buffers, host wall time, and the copies' GB/s;
- `work`: a fixed GPU workload alone (bf16 matmuls, about one training step), then `work+capture`: the same
  workload with a capture started from an event recorded before it (the snapshot's path), and when the
  capture ended relative to the workload;
- `launches` / `launches+pin`: a loop of small synchronised GPU steps alone, then while another thread
  allocates pinned buffers (whether the allocation stalls the training thread).

usage: python bench/gpu_capture.py [--model gpt2-medium] [--quick]   (--quick: a CPU smoke run of the script)
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_single import model_config


def _workload(device, size: int, repeats: int):
    import torch

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def run():
        x = a
        for _ in range(repeats):
            x = (x @ a) / size
        return x

    return run


def main() -> int:
    import torch

    from oobleck.runtime.train.config import OptimConfig, WorkerConfig, build_model
    from oobleck.runtime.train.layer_state import PinnedBuffers, capture_layers, state_nbytes
    from oobleck.runtime.train.optim import LayerAdamW

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.quick else "cuda")
    model = build_model(WorkerConfig(job="capture", model=model_config("tiny-gpt" if args.quick else args.model)))
    optimizer = LayerAdamW(OptimConfig())
    layers = []
    for index in range(model.num_layers):
        module = model.build_layer(index).to(device)
        optimizer.ensure_layer(index, module)
        layers.append((index, module))
    total = sum(sum(t.numel() * t.element_size() for t in _state(i, m, optimizer)) for i, m in layers)
    figures: dict = {"device": str(torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"), "bytes": total}
    sizes = {i: sum(t.numel() * t.element_size() for t in _state(i, m, optimizer)) for i, m in layers}
    assert all(sizes[i] >= state_nbytes(m) for i, m in layers)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    buffers = PinnedBuffers() if device.type == "cuda" else None
    if buffers is not None:
        started = time.perf_counter()
        buffers.prepare(sizes)
        figures["pin_s"] = time.perf_counter() - started
    sync()
    started = time.perf_counter()
    capture_layers(layers, optimizer, buffers=buffers)
    figures["capture_s"] = time.perf_counter() - started
    figures["capture_GBps"] = total / figures["capture_s"] / 1e9
    if buffers is not None:
        # One device-side concatenation per layer, then one copy per layer (instead of one per tensor).
        buffers.prepare(sizes)
        sync()
        started = time.perf_counter()
        for index, module in layers:
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in _state(index, module, optimizer)])
            buffers.take(flat.numel()).copy_(flat, non_blocking=True)
        sync()
        figures["capture_staged_s"] = time.perf_counter() - started
        block = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        for kind, host in (
            ("pinned", torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)),
            ("pageable", torch.empty(1 << 30, dtype=torch.uint8)),
        ):
            host.copy_(block)
            sync()
            started = time.perf_counter()
            host.copy_(block, non_blocking=True)
            queued = time.perf_counter() - started
            sync()
            figures[f"d2h_{kind}_GBps"] = (1 << 30) / (time.perf_counter() - started) / 1e9
            figures[f"d2h_{kind}_queue_s"] = queued
        buffers.prepare(sizes)
    work = _workload(device, 256 if args.quick else 8192, 2 if args.quick else 300)
    work()
    sync()
    started = time.perf_counter()
    work()
    sync()
    figures["work_s"] = time.perf_counter() - started
    if device.type == "cuda":
        start = torch.cuda.Event()
        start.record()
        started = time.perf_counter()
        work()
        done = torch.cuda.Event()
        done.record()
        ended: dict = {}

        def capture():
            capture_layers(layers, optimizer, start=start, ordered=lambda event: None, buffers=buffers)
            ended["capture"] = time.perf_counter() - started
            ended["work_done_then"] = done.query()

        thread = threading.Thread(target=capture)
        thread.start()
        done.synchronize()
        figures["work+capture_s"] = time.perf_counter() - started
        thread.join()
        figures["capture_ended_s"] = ended["capture"]
        figures["work_done_when_capture_ended"] = ended["work_done_then"]
        small = _workload(device, 4096, 4)

        def launches(n: int = 100) -> float:
            began = time.perf_counter()
            for _ in range(n):
                small()
                sync()
            return time.perf_counter() - began

        launches(10)
        figures["launches_s"] = launches()
        pin = threading.Thread(target=lambda: PinnedBuffers().prepare(sizes))
        began = time.perf_counter()
        pin.start()
        figures["launches+pin_s"] = launches()
        pin.join()
        figures["pin_beside_s"] = time.perf_counter() - began
    for key, value in figures.items():
        print(f"{key:32s} {value:.4f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0


def _state(layer, module, optimizer):
    from oobleck.runtime.train.layer_state import _tensors

    return list(_tensors(layer, module, optimizer))


if __name__ == "__main__":
    sys.exit(main())
