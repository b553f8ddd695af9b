"""A model directory with another model's configuration and tokenizer and seeded random weights (bf16
safetensors): the same cost per token, for benchmarks on a machine the real weights cannot reach.

    python benchmarks/random_model.py ~/.cache/reft-alpaca/SmolLM2-135M-Instruct-float32 /tmp/smollm2-random
    MODEL=/tmp/smollm2-random bash benchmarks/gpu_check.sh

SOURCE needs only config.json and the tokenizer files, not the weights.
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "tokenizer.model")


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    config = AutoConfig.from_pretrained(source)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-derived config's, not a property of the random weights
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    print(f"{target}: {config.model_type}, {sum(p.numel() for p in model.parameters()):,} parameters, random")


if __name__ == "__main__":
    main()
