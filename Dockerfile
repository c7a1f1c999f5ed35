# syntax=docker/dockerfile:1
#
# One image runs the operator (`oobleck operator`), the training workers (`oobleck worker`) and each
# job's coordinator (the `python -m oobleck.runtime...` command the operator renders).
#
#   The operator, CPU and GPU workers (torch from pip's configured index: on Linux x86-64 its wheels
#   bundle the CUDA libraries):
#     docker build -t ghcr.io/oobleck-dev/oobleck:0.1.0 .
#   Other torch builds: TORCH_INDEX_URL names the wheel index to take torch from, e.g. PyTorch's own
#   index for CPU-only wheels (a much smaller image for the operator and device: cpu workers) or for one
#   CUDA version; with a CUDA base image (Python >= 3.11 is installed from its distribution if missing:
#   Ubuntu 24.04 bases ship 3.12):
#     docker build -t ghcr.io/oobleck-dev/oobleck-cuda:0.1.0 \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=<the index of torch's CUDA 12.8 wheels> .
#   Without a Docker engine: `make image` (scripts/image/build) builds this same file with buildah,
#   FROM a Debian base it makes itself.
#
# Stages: `base` (the interpreter the others share), `requirements` (pyproject's dependency lists as
# files), `build` (a compiler; builds the wheel with the Cython planner), `runtime` (base, no
# compiler, user 65532). The runtime's layers go from the least to the most often changed: the
# environment with torch, then the other dependencies, then only the project's wheel on top, so a
# source edit remakes a layer of a few megabytes, not the gigabytes of torch.
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

# pyproject.toml's requirement lists, one file each: the layers that install them are reused until
# the requirements themselves change, not on every edit of pyproject.toml.
FROM base AS requirements
WORKDIR /requirements
COPY pyproject.toml ./
RUN python3 -c 'import re, tomllib; \
        pyproject = tomllib.load(open("pyproject.toml", "rb")); \
        deps = pyproject["project"]["dependencies"]; \
        torch = [d for d in deps if re.match(r"[\w.-]+", d).group().lower() == "torch"]; \
        assert len(torch) == 1, f"pyproject.toml: one torch requirement expected in {deps}"; \
        open("torch.txt", "w").write(torch[0] + "\n"); \
        open("dependencies.txt", "w").write("".join(d + "\n" for d in deps if d not in torch)); \
        open("build-system.txt", "w").write("".join(d + "\n" for d in pyproject["build-system"]["requires"]))' \
    && rm pyproject.toml

FROM base AS build
# A C compiler for the Cython planner; Python's headers where the base image lacks them.
RUN headers=$(python3 -c 'import os, sysconfig; print("" if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3-dev")') \
    && apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev ${headers} \
    && rm -rf /var/lib/apt/lists/*
# The build backend (setuptools, Cython) installed once, so a source edit rebuilds offline.
COPY --from=requirements /requirements/build-system.txt /requirements/
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install --upgrade pip \
    && /opt/build/bin/pip install -r /requirements/build-system.txt
WORKDIR /src
# The compiled planner first, in a layer of its own: an edit elsewhere reuses it (build/, up to date) and the
# wheel takes seconds, not the half minute of compiling planner_cy/_*.pyx.
COPY pyproject.toml setup.py ./
COPY planner_cy/ planner_cy/
RUN /opt/build/bin/python setup.py build_ext
# The package-dir folders of pyproject.toml: oobleck, oobleck.operator, oobleck.runtime, oobleck.planner, oobleck.simulate.
COPY README.md ./
COPY src/ src/
COPY operator/ operator/
COPY runtime/ runtime/
COPY simulator/ simulator/
# The wheel; the runtime stage installs it.
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

FROM base AS runtime
# The user the Helm chart and the worker pods run as (runAsUser/runAsGroup 65532).
RUN groupadd --gid 65532 oobleck \
    && useradd --uid 65532 --gid 65532 --home-dir /home/oobleck --create-home --shell /usr/sbin/nologin oobleck
RUN python3 -m venv /opt/oobleck && /opt/oobleck/bin/pip install --upgrade pip
# Where torch comes from: empty (the default), pip's configured index; else the wheel index it names. The
# repository names no index host: the builder's pip configuration or this argument does.
ARG TORCH_INDEX_URL=
# torch first, in a layer of its own (the largest, and the least often changed).
COPY --from=requirements /requirements/torch.txt /requirements/
RUN /opt/oobleck/bin/pip install ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} -r /requirements/torch.txt
COPY --from=requirements /requirements/dependencies.txt /requirements/
RUN /opt/oobleck/bin/pip install -r /requirements/dependencies.txt
# The top layers: the project's wheel alone (no dependency resolution, nothing downloaded). Prove the
# compiled planner loads, every entry point answers and the environment's requirements hold.
COPY --from=build /wheels/ /wheels/
RUN /opt/oobleck/bin/pip install --no-deps --no-index /wheels/*.whl \
    && /opt/oobleck/bin/pip check \
    && /opt/oobleck/bin/python -c 'import oobleck.planner; print("planner:", oobleck.planner.COMPILED_MODULES)' \
    && /opt/oobleck/bin/oobleck operator --help >/dev/null \
    && /opt/oobleck/bin/oobleck worker --help >/dev/null
ENV PATH=/opt/oobleck/bin:${PATH} \
    HOME=/home/oobleck
USER 65532:65532
WORKDIR /home/oobleck
# Operator: liveness 8080, metrics 9090. Worker pods: coordinator store 29400, workers 29500.
EXPOSE 8080 9090 29400 29500
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="oobleck" \
      org.opencontainers.image.description="Oobleck operator and training runtime (resilient pipeline- and data-parallel training)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/oobleck-dev/oobleck-operator"
ENTRYPOINT ["oobleck"]
CMD ["--help"]
