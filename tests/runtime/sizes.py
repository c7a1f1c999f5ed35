"""Sizes the runtime tests share (imported, not a conftest: a conftest imported as a module would load twice)."""

PIPELINED_MEMORY = 1_400_000
"""bytes per GPU: tiny-gpt then needs 2-3 nodes per pipeline (see the planner's memory model)"""


def exact_config(job: str, steps: int, seed: int):
    """A small CPU WorkerConfig whose every loss the single-process reference matches to 1e-5: float64 gradient
    sums, microbatches of 2, warm-up over 2 steps, a 10 ms poll (quick interruptions)."""
    from oobleck.runtime.train.config import OptimConfig, WorkerConfig

    return WorkerConfig(
        job=job,
        gradient_sum_dtype="float64",
        microbatch_size=2,
        steps=steps,
        seed=seed,
        optim=OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=steps),
        timeouts={"poll": 0.01},
    )
