"""The models a job trains, as the planner's layers: the layered-model interface, the built-in GPT, the
`transformers` families, Hugging Face checkpoints and tokenizing.

May import `oobleck.api` and `oobleck.runtime.errors` (and `train.data` for batch shapes); nothing that runs
a distributed step.
"""
