"""The local backend, `oobleck launch`: a whole elastic job on one machine without Kubernetes (coordinator,
plan controller, worker processes, fault injection, the run's summary)."""
