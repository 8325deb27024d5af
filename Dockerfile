# syntax=docker/dockerfile:1
# vllm-dp-operator image: the kopf operator, nothing else. Build: make image
#   docker build -t vllm-dp-operator:dev .

# Base image by digest, not by tag: a tag moves, a digest is the one image that was reviewed.
# Refresh it on purpose (`docker buildx imagetools inspect python:3.11-slim` names the current
# index digest) and rebuild; both stages use the same one.
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

# --- builder: the operator and the launcher as wheels (dependencies install at runtime) ---
# The operator imports the launcher's plan module (the one definition of the head job's plan).
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY engine_image/pyproject.toml engine_image/README.md engine_image/
COPY engine_image/vllm_dp_launcher/ engine_image/vllm_dp_launcher/
# Every third-party package the runtime installs, pinned with its sha256 (hack/lock_operator.py).
COPY operator/requirements.lock /wheels/
RUN pip wheel --no-deps --wheel-dir /wheels . ./engine_image

# --- runtime: the wheel and its dependencies, run as a non-root user ---
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="vllm-dp-operator" \
      org.opencontainers.image.description="Kubernetes operator for data-parallel vLLM on KubeRay" \
      org.opencontainers.image.licenses="Apache-2.0"
# No .pyc writes: the chart mounts the root filesystem read-only.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The dependencies from the hash lock only (--no-deps: nothing else is resolved or fetched, and
# a file whose sha256 differs fails the build), then both wheels without dependencies. The
# launcher declares none of its own (Ray is its engine extra): the operator uses only its pure
# plan module. The import check fails if the lock left out anything the operator imports.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-deps --require-hashes -r /wheels/requirements.lock \
    && pip install --no-cache-dir --no-deps /wheels/*.whl \
    && python -c "import vllm_dp_operator.cli, vllm_dp_operator.plan, vllm_dp_launcher.plan" \
    && groupadd --gid 10001 vllmdp \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin vllmdp
USER 10001:10001
WORKDIR /tmp
# kopf's liveness endpoint (the chart's livenessProbe).
EXPOSE 8080
ENTRYPOINT ["kopf", "run", "--standalone", "--liveness=http://0.0.0.0:8080/healthz", "-m", "vllm_dp_operator.handlers"]
# Watch scope; the chart replaces it with --all-namespaces or --namespace=<ns>.
CMD ["--all-namespaces"]
