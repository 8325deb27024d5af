# syntax=docker/dockerfile:1
# TEST-ONLY engine image for the kind e2e tier; never published.
# The real engine image (Ray, the launcher, vLLM) with `vllm` on PATH replaced by a double:
# tests/doubles/vllm (records argv, serves /health) behind tests/e2e/openai_double.py (serves
# OpenAI-shaped answers on the pod network). Everything but vLLM itself runs for real.
# Build from the repository root:
#   docker build -f tests/e2e/engine-double.Dockerfile \
#     --build-arg ENGINE_IMAGE=vllm-dp-engine:0.1.0 -t vllm-dp-engine-double:e2e .
ARG ENGINE_IMAGE=vllm-dp-engine:0.1.0
FROM ${ENGINE_IMAGE}
COPY --chmod=0755 tests/doubles/vllm /opt/vllm-double/vllm-recorder
COPY --chmod=0755 tests/e2e/openai_double.py /opt/vllm-double/vllm
# First on PATH, ahead of the real `vllm` entry point the launcher would otherwise exec.
ENV PATH="/opt/vllm-double:${PATH}"
