"""Make the CPU engine test image's LoRA adapters for the tiny model (build_model.py).

    python3 build_adapters.py /models/tiny /models/tiny-lora

Three PEFT LoRA adapters, `sql`, `chat` and `json` (rank 8 on q_proj and v_proj of both
layers, random weights, seeds 1 to 3), and `wide` (rank 32: above the examples' maxLoraRank
16, so vLLM refuses it at load). Each is a directory of adapter_config.json and
adapter_model.safetensors, as PEFT saves one, written directly from the model's config (no
peft package in the image).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

ADAPTERS = {"sql": (8, 1), "chat": (8, 2), "json": (8, 3), "wide": (32, 4)}  # name: (rank, seed)
TARGETS = ("q_proj", "v_proj")


def main(model: str, out: str) -> None:
    """Write each adapter under `out`/<name>."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim,
            "v_proj": cfg["num_key_value_heads"] * head_dim}  # fmt: skip
    for name, (rank, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        tensors = {}
        for layer in range(layers):
            for module in TARGETS:
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden) * 0.01
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(outs[module], rank) * 0.01
        where = os.path.join(out, name)
        os.makedirs(where, exist_ok=True)
        save_file(tensors, os.path.join(where, "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                  "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
                  "target_modules": list(TARGETS), "base_model_name_or_path": model,
                  "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
                  "use_dora": False}  # fmt: skip
        with open(os.path.join(where, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=1)
    print(f"LoRA adapters in {out}: {sorted(os.listdir(out))}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
