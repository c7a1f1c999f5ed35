"""Training on one rank: the 1F1B engine, process groups, optimizer, data, the non-finite policy, the
profiler and the worker's metrics.

Owns everything a rank does inside one plan generation. May import `oobleck.api`, `oobleck.runtime.models`,
`oobleck.runtime.errors` and `oobleck.runtime.causes`; never `elastic`, `snapshot` or `backends`.
"""
