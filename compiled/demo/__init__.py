"""Small trained demo models shipped with the package (the embedded default), built reproducibly
by build.py; README.md here says what they do."""

import os

DEMO_DIR: str = os.path.dirname(os.path.abspath(__file__))

#: Qwen3MoeForCausalLM (layers 1 and 3 MoE, 0 and 2 dense) + byte-level BPE tokenizer.json
MOE_MODEL: str = os.path.join(DEMO_DIR, "qwen3-moe")
#: Qwen3ForCausalLM (tied embeddings) + sentencepiece tokenizer.model
DENSE_MODEL: str = os.path.join(DEMO_DIR, "qwen3-dense")

#: adapter name -> PEFT LoRA folder; "upper" targets the MLP projections (for the MoE
#: model also the fused experts), "first" the attention projections.
MOE_ADAPTERS: dict[str, str] = {
    name: os.path.join(DEMO_DIR, "qwen3-moe-lora", name) for name in ("upper", "first")
}
DENSE_ADAPTERS: dict[str, str] = {
    name: os.path.join(DEMO_DIR, "qwen3-dense-lora", name) for name in ("upper", "first")
}

#: Prompts of clearly different lengths that both models answer confidently (greedy).
#: "count N:" counts up forever (never emits EOS); "copy ...:" copies the words and
#: "COPY ...:" copies them in uppercase, both ending with EOS.  Copied words use the
#: letters abdefghijklmqrsvwxz (either case); see README.md.
EXAMPLE_PROMPTS: list[str] = [
    "count 7:",
    "copy hi:",
    "count 95:",
    "copy Bird wax:",
    "COPY jam:",
    "count 296:",
    "copy Mad brave fish:",
    "<|user|>count 41:<|assistant|>",
    "copy qaz dweb Kilms rav:",
    "<|user|>copy Glam fizz:<|assistant|>",
    "COPY Half sea Wizard jabs:",
    "copy jade grim Fax wheels SHIV zebra:",
]

__all__ = [
    "DEMO_DIR",
    "MOE_MODEL",
    "DENSE_MODEL",
    "MOE_ADAPTERS",
    "DENSE_ADAPTERS",
    "EXAMPLE_PROMPTS",
]
