"""Single-process reference trainer: the oracle the distributed engine must match.

The whole model in one process, the same global batch (microbatches 0..B-1 of each step), the mean
loss over all samples, and the stock `torch.optim.AdamW` with the same schedule. Gradients of each
microbatch are accumulated in `gradient_sum_dtype` as the engine does (runtime/train/engine.py); with float64
the two differ only in the order of float64 additions (~1e-16 relative), far inside the test tolerance.
Precision and recomputation run through the engine's own `run_layer` under the same autocast, and
`max_grad_norm` clips with the stock `torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from oobleck.runtime.models.layered import layer_seed
from oobleck.runtime.train.compute import autocast, run_layer
from oobleck.runtime.train.config import WorkerConfig, build_dataset, build_model
from oobleck.runtime.train.optim import learning_rate, torch_adamw


@dataclass
class ReferenceState:
    """Where a reference run stopped, enough to go on from there exactly: the data and the learning rate are
    functions of the step, so the model's parameters and the optimizer's state are all that is carried."""

    step: int
    """The first step not yet trained."""
    parameters: list[torch.Tensor]
    """Every parameter, each shared one once, in the model's order (on the CPU)."""
    optimizer: dict
    """The optimizer's state_dict."""


@dataclass
class ReferenceResult:
    losses: list[float]
    """Mean loss over the global batch of every step trained by this call (before that step's update)."""
    layers: list[dict[str, torch.Tensor]]
    """Final parameters of every layer, by parameter name."""
    state: ReferenceState
    """The state after the last step: `resume` it to train the steps after them."""


def train_reference(
    config: WorkerConfig,
    global_microbatches: int,
    steps: int | None = None,
    device: torch.device | str = "cpu",
    resume: ReferenceState | None = None,
) -> ReferenceResult:
    """Train the global steps before `steps` (default config.steps) of `global_microbatches` microbatches each,
    from step 0 or from where `resume` stopped; the losses and the state match one run from step 0 exactly.

    Final parameters come back on the CPU whatever `device` ran the training."""
    torch.set_num_threads(config.threads)
    model = build_model(config)
    data = build_dataset(config, model)
    layers = nn.ModuleList(model.build_layer(i) for i in range(model.num_layers)).to(device)
    for tie in model.tied_parameters():  # one shared parameter, as in the unsplit model
        (first, name), *others = tie
        for layer, other in others:
            module, _, attribute = other.rpartition(".")
            setattr(layers[layer].get_submodule(module), attribute, layers[first].get_parameter(name))
    parameters = list(layers.parameters())  # each shared parameter once
    optimizer = torch_adamw(parameters, config.optim)
    first = 0
    if resume is not None:
        with torch.no_grad():
            for parameter, saved in zip(parameters, resume.parameters, strict=True):
                parameter.copy_(saved)
        optimizer.load_state_dict(resume.optimizer)
        first = resume.step
    samples = global_microbatches * config.microbatch_size
    sum_dtype = getattr(torch, config.gradient_sum_dtype)
    recompute = config.recompute == "full"
    losses: list[float] = []
    last = config.steps if steps is None else steps
    for step in range(first, last):
        sums = [torch.zeros_like(p, dtype=sum_dtype) for p in parameters]
        loss_sum = 0.0
        for index in range(global_microbatches):
            inputs, targets = data.microbatch(step, index)
            x, targets = inputs.to(device), targets.to(device)
            with autocast(torch.device(device), config.precision):
                for number, layer in enumerate(layers):
                    if model.stochastic:
                        torch.manual_seed(layer_seed(config.seed, step, index, number))
                    x = run_layer(layer, x, recompute)
                loss = model.loss(x, targets).sum()
            loss.backward()
            loss_sum += float(loss.detach().double())
            for total, parameter in zip(sums, parameters):
                total += parameter.grad
                parameter.grad = None
        for total, parameter in zip(sums, parameters):
            parameter.grad = (total / samples).to(parameter.dtype)
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm, foreach=False)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config.optim, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum / samples)
    final = [{name: p.detach().cpu().clone() for name, p in layer.named_parameters()} for layer in layers]
    state = ReferenceState(
        step=max(first, last),
        parameters=[p.detach().cpu().clone() for p in parameters],
        optimizer=optimizer.state_dict(),
    )
    return ReferenceResult(losses=losses, layers=final, state=state)
