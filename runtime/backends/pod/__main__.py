"""`python -m oobleck.runtime.backends.pod`: the operator's default worker command."""

from oobleck.runtime.backends.pod.main import run_main

run_main()
