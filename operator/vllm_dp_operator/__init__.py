"""vllm-dp-operator: data-parallel vLLM serving on Ray, one resource away."""

__version__ = "0.1.0"
