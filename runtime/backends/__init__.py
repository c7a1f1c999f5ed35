"""Control backends: how a worker learns its plans and reports progress, holdings and failures.

`pod/` runs a worker in a Kubernetes pod (plans from the job's ConfigMap, reports as annotations on its own
pod); `local/` is `oobleck launch`, one machine without Kubernetes (plans from a file written by a local plan
controller). Both build the same worker from `elastic`; nothing below imports a backend.
"""
