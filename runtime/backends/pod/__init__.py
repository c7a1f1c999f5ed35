"""The Kubernetes backend: a worker pod's entry point (`python -m oobleck.runtime.backends.pod`), its
configuration from the operator's environment, the API client, reports on its own pod and multi-GPU
supervision. Follows the operator <-> pod contract, `oobleck.api.contract`."""
