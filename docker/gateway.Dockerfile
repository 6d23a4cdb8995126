# The gateway image: `switchboard gateway` and `switchboard coordinator`. No torch: neither role
# imports it (tests/chart/test_dockerfiles.py checks the import graph), which keeps this image
# a few hundred MB instead of several GB.
#
#   docker build -f docker/gateway.Dockerfile -t switchboard-gateway:0.1.0 .
#
# No HEALTHCHECK: Kubernetes ignores it; the Helm chart probes the gRPC health service
# natively (readiness `switchboard.v1.GenerationService`, liveness "").
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml ./
COPY services ./services
# pyproject.toml's pinned dependencies and its server extra, torch left out; then the package itself.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; deps = p['dependencies'] + p['optional-dependencies']['server']; print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && pip install --no-cache-dir --no-deps /src \
    && python -c "import sys, switchboard.gateway.server, switchboard.coordinator.__main__; assert 'torch' not in sys.modules"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin switchboard
COPY --from=build /opt/venv /opt/venv
USER 10001
# gRPC, engine handshake, the OpenAI-compatible HTTP API, Prometheus /metrics, coordinator load
# and report ports.
EXPOSE 50051 50052 8000 9090 50053 50054
ENTRYPOINT ["switchboard"]
CMD ["gateway", "--help"]
