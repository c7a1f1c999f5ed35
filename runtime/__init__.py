"""oobleck.runtime: the in-container training runtime (torch only; knows nothing about kopf).

Sub-packages by layer, each importing only those before it:

- `models`: the layered model interface, the built-in GPT, the `transformers` families, HF checkpoints;
- `train`: one rank inside one plan generation (1F1B engine, process groups, AdamW, data, profiler);
- `snapshot`: in-memory peer snapshots, their transport and holding store, the checkpoint directory;
- `elastic`: the worker across generations, the generation loop, step commit, failure detection, the
  coordinator's store and its keys, copy sources;
- `backends`: how a worker learns plans and reports (`pod/` on Kubernetes, `local/` for `oobleck launch`).

`errors` and `causes` are the runtime's shared vocabulary of bad input and job-caused failures.
Modules are imported on demand; this package imports nothing heavy.
"""
