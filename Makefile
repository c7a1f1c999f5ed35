# The two commands a fresh machine needs: `make demo` and `make test`. Each installs what it needs.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
PY := .venv/bin/python
# Tests run in parallel; the slow ones share one control plane per worker process.
PYTEST_WORKERS ?= 2

.PHONY: test test-unit test-realnodes lint demo build venv k8s-tools k8s-node node-packages kube-router real-nodes image crds dev-up dev-down bench bench-runtime bench-operator paper-figures

venv:
	@scripts/venv >/dev/null

build: venv

k8s-tools:
	@scripts/k8s-tools/build >/dev/null

# What a real node runs: kubelet, kube-proxy (same k8s.io/kubernetes pins, own cache) and a static pause; installs
# containerd, runc and the CNI plugins (Debian packages) when missing.
k8s-node:
	@scripts/k8s-node/build >/dev/null

# The Debian packages a real node runs (containerd, runc, the CNI plugins, iptables), without the kubelet's build.
node-packages:
	@scripts/k8s-node/build --packages

# The NetworkPolicy-enforcing plugin the real-node tests run on one node: kube-router's firewall, from its Go
# module (own cache); installs ipset when missing.
kube-router:
	@scripts/kube-router/build >/dev/null

# A control plane and two kubelet + containerd nodes running the image, until Ctrl-C (root; devtools/oobleck_dev/realnodes.py).
real-nodes: venv k8s-tools k8s-node image
	$(PY) -m oobleck_dev real-nodes

# The Dockerfile built with buildah (no Docker engine needed); prints the image's name. Cached by
# its inputs outside the repository: an unchanged tree builds nothing (scripts/image/build).
image:
	@scripts/image/build

# The CRD YAML is generated from the pydantic models; the helm chart carries a copy of it.
crds: venv
	$(PY) -m oobleck.cli crds --write crds/
	$(PY) -m oobleck_dev.chart --write

# The suite on local nodes with PYTEST_WORKERS workers and, beside it at nice 19, the jobs in containers on real
# kubelet + containerd nodes (scripts/test); REALNODES=0 leaves the real nodes out.
REALNODES ?= 1
test: venv k8s-tools image node-packages k8s-node kube-router
	@PYTEST_WORKERS=$(PYTEST_WORKERS) PYTEST_ARGS="$(PYTEST_ARGS)" REALNODES="$(REALNODES)" REALNODES_ARGS="$(REALNODES_ARGS)" \
	  scripts/test

# The real-node tests alone (root; tests/realnodes), one at a time.
test-realnodes: venv k8s-tools k8s-node kube-router image
	$(PY) -m pytest --realnodes -n 0 tests/realnodes $(PYTEST_ARGS)

# The fast tier: pure tests (no cluster, no processes, no GPU, no Kubernetes tools); see tests/conftest.py.
test-unit: venv
	$(PY) -m pytest --unit -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# What `make test` checks of the code's form (tests/test_lint.py runs the same), and what pre-commit runs.
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	MYPY_CACHE_DIR="$${OOBLECK_CACHE:-$$HOME/.cache/oobleck}/mypy" \
	  $(PY) -m mypy --config-file pyproject.toml "$$($(PY) -c 'import oobleck; print(oobleck.__path__[0])')"

# DEMO_ARGS=--real-nodes runs the same story in containers on kubelet + containerd nodes (root; builds the kubelet
# and the image the first time).
demo: venv k8s-tools
	$(PY) -m oobleck_dev demo $(DEMO_ARGS)

dev-up: venv k8s-tools
	$(PY) -m oobleck_dev up

dev-down: venv
	$(PY) -m oobleck_dev down

# Benchmarks print figures (ratios against a baseline measured in the same run); see README.
bench: venv
	$(PY) bench/planner_templates.py
	$(PY) bench/planner_plans.py

bench-runtime: venv
	$(PY) bench/recovery.py
	$(PY) bench/overhead.py
	$(PY) bench/detector_idle.py
	$(PY) bench/vs_torch.py

bench-operator: venv k8s-tools
	$(PY) bench/operator_scale.py

# Our versions of the Oobleck paper's simulator figures (Figs. 1, 9, 10, 12-15) as PNGs under docs/ (README,
# "Simulating goodput"); about 10 s. `.venv/bin/python -m oobleck.simulate.paper --quick --out DIR`: seconds.
paper-figures: venv
	$(PY) -m oobleck.simulate.paper --out docs
