# The Tidal image: the gateway, the fleet supervisor, the flows (Prefect work-pool jobs), the trainer and the
# checkpoint fetcher of the engine pods all run from it. Build from the repository root:
#   docker build -f infra/docker/platform.Dockerfile -t REGISTRY/tidal:$(git rev-parse --short HEAD) .
# The chart and the work pool run it as uid 10001 with a read-only root filesystem; settings come from the
# mounted ConfigMap (TIDAL_CONFIG) and credentials from Secrets: nothing secret is built in.

# Pinned: Python 3.11 (pyproject's requires-python) on Debian 12, one exact patch release.
FROM python:3.11.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DO_NOT_TRACK=true \
    MLFLOW_DISABLE_TELEMETRY=true

# The pinned dependency set first (a layer that changes only with requirements/platform.txt). torch==2.13.0
# from PyPI is its CUDA build on x86_64: the trainer pods have GPUs, the CPU pods run it on the CPU.
WORKDIR /opt/tidal
COPY requirements/platform.txt requirements/platform.txt
RUN python -m pip install -r requirements/platform.txt

# The code. The working directory is the repository root: the deployments' entrypoints (flows/*.py) resolve there.
COPY pyproject.toml README.md ./
COPY tidal tidal
COPY serving serving
COPY training training
COPY flows flows
COPY tasks tasks
COPY data_contracts data_contracts
COPY release release
COPY capacity capacity
COPY sim sim
COPY infra/monitoring infra/monitoring
RUN python -m pip install --no-deps --no-build-isolation . \
 && groupadd --gid 10001 tidal \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tidal

# Non-root, as the pods' securityContext (runAsUser 10001) requires; HOME on the writable /tmp volume.
USER 10001:10001
ENV HOME=/tmp
CMD ["tidal", "--help"]
