# The engine image: `switchboard engine`, one engine core and its TP x PP workers (torch).
#
#   CPU:  docker build -f docker/engine.Dockerfile -t switchboard-engine:0.1.0 .
#   CUDA: docker build -f docker/engine.Dockerfile \
#           --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#           -t switchboard-engine:0.1.0-cu128 .
#
# The CUDA wheels bundle the CUDA runtime, NCCL and cuDNN, so the same slim base serves both;
# only the NVIDIA driver comes from the node (NVIDIA container runtime / device plugin).
# No HEALTHCHECK: Kubernetes ignores it; the chart's exec probe checks that the engine core
# and every worker process are up (engines serve no port of their own).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml ./
COPY services ./services
# torch first, from the chosen index at pyproject.toml's pin (its server extra); then the other
# pinned dependencies and the server extra from PyPI (torch is already satisfied); then the
# package itself.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; deps = p['dependencies'] + p['optional-dependencies']['server']; print('\n'.join(d for d in deps if d.startswith('torch')))" > /tmp/torch.txt \
    && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; deps = p['dependencies'] + p['optional-dependencies']['server']; print('\n'.join(deps))" > /tmp/requirements.txt \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" -r /tmp/torch.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps /src

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
# A C compiler: the worker builds its CPU kernels (kernels/csrc, with -march=native for the node
# it runs on, so not at image build) when it first starts, into $HOME/.cache (the pod's /tmp
# emptyDir); without one it falls back to torch's operators, several times slower on CPU (one
# user of the default quantized model: about 15x). libc6-dev for the C library's headers (gcc
# brings its own: immintrin.h, omp.h, and libgomp for -fopenmp). Unpinned: the base image's
# Debian release fixes their versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin switchboard
COPY --from=build /opt/venv /opt/venv
USER 10001
ENTRYPOINT ["switchboard"]
CMD ["engine", "--help"]
