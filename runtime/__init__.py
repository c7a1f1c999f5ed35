"""oobleck.runtime: the in-container training runtime (torch only; knows nothing about kopf).

Execution: models, data, config, engine (1F1B + per-layer gradient sums), optim (AdamW keyed by
layer), groups (process groups per plan generation), state (layer state transfer), worker,
reference (the single-process oracle), profiler, metrics. Control: coordinator, health, plansource,
reconfig, launcher. In a pod: kube (a small Kubernetes API client), pod (the worker pod's entry point,
`python -m oobleck.runtime.pod`). Modules are imported on demand; this package imports nothing heavy.
"""
