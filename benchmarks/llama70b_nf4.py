"""Train ReFT on a random base of Llama-3.1-70B's shapes, built directly in NF4 on the device it trains on, layer
by layer: each linear weight is drawn directly as NF4 codes and scales (what quantizing normal weights gives), so
no full-precision copy of the model, nor of any of its weights, exists anywhere, and nothing is written to disk.
train.py's loop trains it as a base loaded with --load_in_4bit: its flags, checks, strategy, quantization settings
and loop all run; only where transformers would read a config and weights (AutoConfig in alpaca.model and
alpaca.resume, AutoModelForCausalLM.from_pretrained in alpaca.model) this script answers with the 70B config and
the built base.

    python benchmarks/llama70b_nf4.py --model_name_or_path /tmp/smollm2-random --data_path DATA \
        --gradient_checkpointing --max_steps 10 ...                                  # the whole 70B, on a GPU
    python benchmarks/llama70b_nf4.py --num_hidden_layers 2 --vocab_size 512 --dtype bfloat16 ...   # on a CPU

Every flag but this script's own two goes to train.py (--load_in_4bit is added). --model_name_or_path only lends
its tokenizer (its ids must fit the vocabulary); a checkpoint's fingerprint of the base is of that directory's
files, not of the random weights. At the end it prints the peak memory since the build beside its formula
(`memory_formula`): the NF4 layers (0.5 byte a parameter and a float32 scale per 64), the embeddings and LM head in
the compute dtype, one weight dequantized for its matmul, and the activations the backward keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # train.py and alpaca/, run from anywhere

LLAMA_3_1_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                     rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
PROG = "llama70b_nf4.py"
BLOCKSIZE = 64  # bitsandbytes' 4-bit block: one scale per 64 values


def llama70b_config(num_hidden_layers: int, vocab_size: int, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(**{**LLAMA_3_1_70B, "num_hidden_layers": num_hidden_layers, "vocab_size": vocab_size},
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def build_nf4_base(config, quantization, device: torch.device, seed: int = 0):
    """Build `config`'s causal LM with random weights where it runs, its linear layers in NF4 as bitsandbytes holds
    them after from_pretrained(quantization_config=`quantization`): embeddings, norms and LM head in the compute
    dtype, normal(0, initializer_range). The skeleton is on meta; each linear weight is drawn directly as NF4 (its
    `random_nf4` codes and scales), in module order: no weight ever exists in full precision."""
    import bitsandbytes as bnb
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from alpaca.sharding import quantize_empty_base

    dtype = quantization.bnb_4bit_compute_dtype
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    quantize_empty_base(model, quantization)  # Linear4bit on meta, and the config and quantizer on the model
    generator = torch.Generator(device).manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            packed, state = random_nf4(module.out_features, module.in_features, dtype, module.weight.blocksize,
                                       module.weight.compress_statistics, config.initializer_range, generator)
            module.weight = bnb.nn.Params4bit(packed.view(module.quant_storage).reshape(-1, 1), requires_grad=False,
                                              quant_state=state, blocksize=state.blocksize, quant_type="nf4",
                                              compress_statistics=module.weight.compress_statistics,
                                              quant_storage=module.quant_storage, module=module, bnb_quantized=True)
            module.quant_state = state
            continue
        for key, parameter in module.named_parameters(recurse=False):
            value = torch.empty(parameter.shape, dtype=dtype, device=device)
            if "norm" in name:
                value.fill_(1.0)
            else:
                value.normal_(0.0, config.initializer_range, generator=generator)
            module._parameters[key] = torch.nn.Parameter(value, requires_grad=False)
        for key, buffer in module.named_buffers(recurse=False):
            module._buffers[key] = buffer.to(device)
    return model


def random_nf4(rows: int, columns: int, dtype: torch.dtype, blocksize: int, double_quant: bool, std: float,
               generator: torch.Generator):
    """Return the packed bytes (two 4-bit codes each) and bitsandbytes' QuantState of a random rows x columns weight
    in NF4: codes uniform over NF4's 16 levels, which are N(0, 1)'s equal-probability quantiles, so the codes are
    distributed as those of quantized N(0, std^2) weights; the blocks' scales (absmax) spread by +-10 % around the
    one that makes the weight's standard deviation `std`; with `double_quant` the scales quantized as bitsandbytes
    quantizes them."""
    import bitsandbytes.functional as bnb_functional

    device = generator.device
    packed = torch.randint(0, 256, ((rows * columns + 1) // 2,), dtype=torch.uint8, device=device, generator=generator)
    code = bnb_functional.get_4bit_type("nf4", device=device)
    absmax = torch.empty(-(-rows * columns // blocksize), dtype=torch.float32, device=device)
    absmax.uniform_(0.9, 1.1, generator=generator).mul_(std / code.square().mean().sqrt().item())
    shape = torch.Size((rows, columns))
    if not double_quant:
        return packed, bnb_functional.QuantState(absmax=absmax, shape=shape, dtype=dtype, blocksize=blocksize,
                                                 code=code, quant_type="nf4")
    offset = absmax.mean()
    quantized_absmax, absmax_state = bnb_functional.quantize_blockwise(absmax - offset, blocksize=256)
    return packed, bnb_functional.QuantState(absmax=quantized_absmax, shape=shape, dtype=dtype, blocksize=blocksize,
                                             code=code, quant_type="nf4", offset=offset, state2=absmax_state)


@dataclass
class MemoryFormula:
    """What a built base and its training hold at their peak, in bytes, from the config alone."""

    nf4_layers: int  # 0.5 byte a parameter, a float32 scale per BLOCKSIZE (double quantization: a byte, + 1/256)
    unquantized: int  # embeddings, LM head and norms in the compute dtype
    dequantized: int  # the largest weight dequantized for its matmul, and the copy a CPU matmul may reorder it into
    activations: int  # what autograd keeps above the first intervened layer, and the logits

    @property
    def total(self) -> int:
        return self.nf4_layers + self.unquantized + self.dequantized + self.activations

    def describe(self) -> str:
        parts = ", ".join(f"{name.replace('_', ' ')} {value / 2**30:.2f}" for name, value in vars(self).items())
        return f"{self.total / 2**30:.2f} GiB ({parts})"


def memory_formula(config, dtype: torch.dtype, double_quant: bool, tokens: int, layers_with_grad: int,
                   checkpointed: bool) -> MemoryFormula:
    """The peak of training the built base on micro-batches of at most `tokens` (batch x padded length), the
    backward running through `layers_with_grad` decoder layers. Such a layer keeps, in the compute dtype, about 8
    hidden-wide and 4 intermediate-wide values a token (norm inputs and outputs, q/k/v and attention outputs,
    residuals; gate, up, their SiLU product, the down projection's input), or checkpointed its input alone, plus one
    layer's whole during its recomputation; the logits are kept in the compute dtype and in float32 (the loss)."""
    hidden, intermediate, width = config.hidden_size, config.intermediate_size, torch.finfo(dtype).bits // 8
    attention = config.num_attention_heads * config.head_dim
    key_value = config.num_key_value_heads * config.head_dim
    shapes = [(attention, hidden), (key_value, hidden), (key_value, hidden), (hidden, attention),
              (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    per_layer = sum(rows * columns for rows, columns in shapes)
    scale_bytes = (1 + 4 / 256) if double_quant else 4
    nf4 = config.num_hidden_layers * int(per_layer * (0.5 + scale_bytes / BLOCKSIZE))
    unquantized = width * (2 * config.vocab_size * hidden + (2 * config.num_hidden_layers + 1) * hidden)
    whole_layer = tokens * (8 * hidden + 4 * intermediate) * width
    kept = layers_with_grad * tokens * hidden * width + whole_layer if checkpointed else layers_with_grad * whole_layer
    logits = tokens * config.vocab_size * (width + 4)
    return MemoryFormula(nf4, unquantized, 2 * width * max(rows * columns for rows, columns in shapes),
                         kept + logits)


def resident_peak_bytes() -> int:
    """This process's peak resident memory (VmHWM) since the last `reset_resident_peak`."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def reset_resident_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM back to the current resident size


def check_fits(weights: MemoryFormula, device: torch.device) -> None:
    """Refuse, in one line, a base whose weights alone exceed what `device` has free, before anything loads: the
    whole 70B (about 41 GiB) on a small GPU or a shared CPU machine would fail late or take others' memory."""
    from alpaca.args import exit_on_usage_error
    from alpaca.errors import UsageError

    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        meminfo = Path("/proc/meminfo").read_text()
        free = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:"))) * 1024
    if weights.total > free:
        exit_on_usage_error(PROG, UsageError(
            f"the built base needs {weights.describe()} for its weights, {device} has {free / 2**30:.2f} GiB free; "
            "build fewer layers (--num_hidden_layers) or a smaller vocabulary (--vocab_size)"))


class BuiltBase:
    """Stands in for transformers' AutoConfig and AutoModelForCausalLM in alpaca.model and alpaca.resume while train.py
    runs: every path's config is `config`; from_pretrained builds the base (build_nf4_base) instead of reading one,
    with the quantization settings and device train.py passes, and refuses to build without NF4 ones."""

    def __init__(self, config) -> None:
        from transformers import AutoModelForCausalLM

        self.config, self.from_config = config, AutoModelForCausalLM.from_config
        self.quantization, self.device = None, None  # what the base was built with, once it is
        self.resident_before = 0  # bytes resident when the build starts, on the CPU

    def config_from_pretrained(self, path: str, **kwargs):
        return self.config

    def from_pretrained(self, path: str, *, dtype: torch.dtype, quantization_config=None, device_map=None, **kwargs):
        if quantization_config is None or quantization_config.bnb_4bit_quant_type != "nf4":
            raise RuntimeError("the built base is NF4: train.py was to load it with --load_in_4bit, quant type nf4")
        self.quantization = quantization_config
        self.device = torch.device(device_map[""]) if device_map else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_resident_peak()
            self.resident_before = resident_peak_bytes()
        started = time.perf_counter()
        model = build_nf4_base(self.config, quantization_config, self.device)
        print(f"built {self.config.num_hidden_layers} NF4 layers of Llama-3.1-70B's widths (vocabulary "
              f"{self.config.vocab_size}) on {self.device} in {time.perf_counter() - started:.1f} s", flush=True)
        return model

    def peak_bytes(self) -> int:
        """The peak memory since the build began: allocated on its GPU, or the growth of resident memory."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resident_peak_bytes() - self.resident_before

    @contextlib.contextmanager
    def standing_in(self):
        import alpaca.model
        import alpaca.resume

        config_class = mock.Mock(from_pretrained=self.config_from_pretrained)
        model_class = mock.Mock(from_pretrained=self.from_pretrained, from_config=self.from_config)
        with (mock.patch.object(alpaca.model, "AutoConfig", config_class),
              mock.patch.object(alpaca.resume, "AutoConfig", config_class),
              mock.patch.object(alpaca.model, "AutoModelForCausalLM", model_class)):
            yield


def parse_own_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_hidden_layers", type=int, default=LLAMA_3_1_70B["num_hidden_layers"],
                        help="decoder layers to build (80: the whole 70B)")
    parser.add_argument("--vocab_size", type=int, default=LLAMA_3_1_70B["vocab_size"],
                        help="embedding rows (128256: Llama-3.1's); at least the tokenizer's size")
    return parser.parse_known_args(argv)


def main(argv: list[str]) -> None:
    own, train_argv = parse_own_flags(argv)
    from alpaca.args import parse_args

    args = parse_args("train.py", ["--load_in_4bit", *train_argv])
    from transformers import AutoTokenizer

    import train
    from alpaca.flag_values import parse_layers
    from alpaca.model import resolve_dtype, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_name_or_path, args.cache_dir))
    config = llama70b_config(own.num_hidden_layers, own.vocab_size, tokenizer)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    check_fits(memory_formula(config, resolve_dtype(args.dtype, device), args.bnb_4bit_use_double_quant, 0, 0, False),
               device)
    base = BuiltBase(config)
    with base.standing_in():
        train.main(args)  # a usage error exits here, as train.py does
    if base.device is None:  # a finished run's requeue: nothing was built
        return
    first_layer = min(parse_layers(args.layers, config.num_hidden_layers))
    tokens = args.per_device_train_batch_size * args.model_max_length
    formula = memory_formula(config, base.quantization.bnb_4bit_compute_dtype,
                             base.quantization.bnb_4bit_use_double_quant, tokens,
                             config.num_hidden_layers - 1 - first_layer, args.gradient_checkpointing)
    kind = f"peak allocated on {base.device}" if base.device.type == "cuda" else "peak resident (VmHWM) growth"
    print(f"memory since the build: {kind} {base.peak_bytes() / 2**30:.2f} GiB; formula for micro-batches of at "
          f"most {tokens} tokens: {formula.describe()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
