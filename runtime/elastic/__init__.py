"""Elasticity: the worker that keeps its layers across plan generations, the generation loop, the step
commit, failure detection, the coordinator's store (and `coordinator`, the one module that spells its keys),
where copies come from, and plan sources.

May import `train`, `models`, `snapshot` and `oobleck.api`; never a backend (`backends/` passes its
collaborators in).
"""
