# syntax=docker/dockerfile:1
# vllm-dp-operator image: the kopf operator, nothing else. Build: make image
#   docker build -t vllm-dp-operator:dev .

# --- builder: turn the project into a wheel (no dependencies; they install at runtime) ---
FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
RUN pip wheel --no-deps --wheel-dir /wheels .

# --- runtime: the wheel and its dependencies, run as a non-root user ---
FROM python:3.11-slim AS runtime
LABEL org.opencontainers.image.title="vllm-dp-operator" \
      org.opencontainers.image.description="Kubernetes operator for data-parallel vLLM on KubeRay" \
      org.opencontainers.image.licenses="Apache-2.0"
# No .pyc writes: the chart mounts the root filesystem read-only.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir /wheels/*.whl \
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
