"""Make the CPU engine test image's tiny model: random weights, a local tokenizer, no hub.

    python3 build_model.py /models/tiny

A Llama-shaped causal LM (hidden 128, 2 layers, 2 attention heads, 1 KV head, head_dim 64:
vLLM's CPU attention rejects smaller heads) with a word-level tokenizer of about 250 words and
a chat template, so /v1/completions and /v1/chat/completions both work. Weights are random
(seed 0) and saved as bfloat16 safetensors, about 0.7 MB; the engine loads them as float32.
It answers with nonsense, which is all a test of the serving path needs. Runs inside the image
build (torch and transformers from the image), with the hub switched off.
"""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
WORDS = [
    "hello", "world", "the", "a", "of", "and", "to", "in", "is", "it", "you", "that", "he",
    "was", "for", "on", "are", "with", "as", "I", "his", "they", "be", "at", "one", "have",
    "this", "from", "or", "had", "by", "user", "assistant", "system",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
VOCAB_SIZE = 256


def main(out: str) -> None:
    """Write the tokenizer, config, generation config and weights to `out`."""
    words = SPECIAL + [f"w{i}" for i in range(200)] + WORDS
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    if len(vocab) > VOCAB_SIZE:
        raise SystemExit(f"vocabulary of {len(vocab)} does not fit {VOCAB_SIZE} embeddings")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(out)
    print(f"tiny model in {out}: vocabulary {len(vocab)}, files {sorted(os.listdir(out))}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/models/tiny")
