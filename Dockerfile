# syntax=docker/dockerfile:1
#
# One image runs the operator (`oobleck operator`), the training workers (`oobleck worker`) and each
# job's coordinator (`python -m oobleck.runtime.elastic.coordinator`).
#
#   CPU (the operator; workers with device: cpu):
#     docker build -t ghcr.io/oobleck-dev/oobleck:0.1.0 .
#   GPU workers: a CUDA base image (Python >= 3.11 is installed from its distribution if missing:
#   Ubuntu 24.04 bases ship 3.12) and the matching torch wheels:
#     docker build -t ghcr.io/oobleck-dev/oobleck-cuda:0.1.0 \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Stages: `base` (the interpreter both others share: the virtual environment built in `build` links
# to it), `build` (a compiler; builds the wheel with the Cython planner and installs it into the
# environment /opt/oobleck), `runtime` (base + /opt/oobleck, no compiler, user 65532).
# tests/test_dockerfile.py keeps this file consistent with pyproject.toml and the Helm chart.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# python:* images have Python with venv; CUDA (Ubuntu) images get the distribution's python3.
RUN if ! python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -c 'import sys; assert sys.version_info >= (3, 11), f"pyproject requires Python >= 3.11; BASE_IMAGE has {sys.version}"'

FROM base AS build
# A C compiler for the Cython planner; Python's headers where the base image lacks them.
RUN headers=$(python3 -c 'import os, sysconfig; print("" if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3-dev")') \
    && apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev ${headers} \
    && rm -rf /var/lib/apt/lists/*
# Where torch comes from: CPU-only wheels by default (the operator and CPU workers need no CUDA);
# e.g. https://download.pytorch.org/whl/cu128 for CUDA 12.8 workers.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python3 -m venv /opt/oobleck && /opt/oobleck/bin/pip install --upgrade pip
WORKDIR /src
# torch first, in a layer of its own that survives source edits (the requirement is pyproject's).
COPY pyproject.toml setup.py README.md ./
RUN torch=$(python3 -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.split(">")[0].split("=")[0].split("<")[0].strip() == "torch"))') \
    && /opt/oobleck/bin/pip install --index-url "${TORCH_INDEX_URL}" "${torch}"
# The package-dir folders of pyproject.toml: oobleck, oobleck.operator, oobleck.runtime, oobleck.planner, oobleck.simulate.
COPY src/ src/
COPY operator/ operator/
COPY runtime/ runtime/
COPY planner_cy/ planner_cy/
COPY simulator/ simulator/
# Build the wheel (compiles planner_cy/_*.pyx), install it with the remaining dependencies, and
# prove the compiled planner loads and every entry point answers.
RUN /opt/oobleck/bin/pip wheel --no-deps --wheel-dir /wheels . \
    && /opt/oobleck/bin/pip install /wheels/*.whl \
    && /opt/oobleck/bin/python -c 'import oobleck.planner; print("planner:", oobleck.planner.COMPILED_MODULES)' \
    && /opt/oobleck/bin/oobleck operator --help >/dev/null \
    && /opt/oobleck/bin/oobleck worker --help >/dev/null \
    && /opt/oobleck/bin/python -m oobleck.runtime.elastic.coordinator --help >/dev/null

FROM base AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="oobleck" \
      org.opencontainers.image.description="Oobleck operator and training runtime (resilient pipeline- and data-parallel training)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/oobleck-dev/oobleck-operator"
# The user the Helm chart and the worker pods run as (runAsUser/runAsGroup 65532).
RUN groupadd --gid 65532 oobleck \
    && useradd --uid 65532 --gid 65532 --home-dir /home/oobleck --create-home --shell /usr/sbin/nologin oobleck
COPY --from=build /opt/oobleck /opt/oobleck
ENV PATH=/opt/oobleck/bin:${PATH} \
    HOME=/home/oobleck
USER 65532:65532
WORKDIR /home/oobleck
# Operator: liveness 8080, metrics 9090. Worker pods: coordinator store 29400, workers 29500.
EXPOSE 8080 9090 29400 29500
ENTRYPOINT ["oobleck"]
CMD ["--help"]
