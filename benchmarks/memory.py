"""Host memory per rank: DDP, --fsdp, --deepspeed ZeRO-2 and ZeRO-3, DDP with half the base offloaded to disk
by --device_map ("disk"), DDP on a bf16 base or a bitsandbytes-quantized one (QReFT: "nf4", "int8"), and --fsdp on
the bf16 and the NF4 base ("fsdp_bf16", "fsdp_nf4"), on 1, 2 and 4 processes (CPU, gloo).

    python benchmarks/memory.py                                   # SmolLM2 and a random 0.49B model, all
    python benchmarks/memory.py --models smollm2 --nproc 2 --strategies ddp fsdp
    python benchmarks/memory.py --models smollm2 --nproc 1 --strategies ddp disk
    python benchmarks/memory.py --models smollm2 --nproc 1 --strategies ddp bf16 nf4 int8 --steps 8
    python benchmarks/memory.py --models smollm2 --nproc 2 4 --strategies nf4 fsdp_nf4 fsdp_bf16
    python benchmarks/memory.py --models random1b --nproc 2 4 --strategies nf4 fsdp_nf4 fsdp_bf16 --model_max_length 128

Each configuration is a real `torchrun train_multigpu.py` run of a few optimizer steps (batch 1). While it
runs, each rank's /proc/<pid>/status is polled: VmHWM (peak resident memory: private memory plus the
file pages it maps, such as a memory-mapped checkpoint) and the peak of RssAnon (private memory only).
"params" is the base-model parameter bytes the rank holds (its shards under --fsdp, its partitions under
ZeRO-3). Every figure is also given as a ratio to one model copy, the base's parameter bytes in the
training dtype. Parameter bytes are not process memory: the RSS figures are what decides whether a job fits on a host.
A quantized base's "params" count each quantized weight with its quantization constants; with --strategies nf4 or
int8 the bytes per quantized parameter (of the quantized linear layers alone) are printed too.

The random model is saved in bfloat16 and trained in float32, as a bf16 hub checkpoint trained in another
dtype would be: without sharded loading, every rank then holds a full private float32 copy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SHARED_DATA = REPO.parent / "shared" / "data" / "alpaca_en_demo.json"
STRATEGIES = {"ddp": [], "fsdp": ["--fsdp"],
              "zero2": ["--deepspeed", str(REPO / "examples" / "deepspeed" / "zero2.json")],
              "zero3": ["--deepspeed", str(REPO / "examples" / "deepspeed" / "zero3.json")],
              # --device_map auto with CPU memory for half a copy (--max_memory, in `measure`): the last layers on
              # disk; "disk_early": the layers before the first intervened one on disk (a JSON map, in `measure`)
              "disk": ["--device_map", "auto"], "disk_early": [],
              # DDP on a bf16 base; on a base bitsandbytes quantizes as it loads (computing in float32, as the others)
              "bf16": ["--dtype", "bfloat16"], "nf4": ["--load_in_4bit"], "int8": ["--load_in_8bit"],
              # --fsdp on the bf16 base, and on the NF4 base (each rank its rows of the packed weights)
              "fsdp_bf16": ["--fsdp", "--dtype", "bfloat16"], "fsdp_nf4": ["--fsdp", "--load_in_4bit"]}
QUANTIZED = {"nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "int8": {"load_in_8bit": True}}
# SmolLM2's vocabulary (its tokenizer is used), untied. "random": hidden 1536, 12 layers, 0.49B parameters,
# 1.97 GB in float32. "random1b": hidden 2048, 16 layers, 1.02B parameters, of which 0.82B in the decoder's
# linear layers (what --load_in_4bit quantizes), so that the sharded part of a 4-bit base outweighs its
# float32 embeddings. Each with the layers it intervenes on.
RANDOM_MODELS = {
    "random": (dict(vocab_size=49152, hidden_size=1536, intermediate_size=4096, num_hidden_layers=12,
                    num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False), "4;8"),
    "random1b": (dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False), "4;8"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "random"], choices=["smollm2", *RANDOM_MODELS])
    parser.add_argument("--nproc", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    parser.add_argument("--data_path", default=str(SHARED_DATA if SHARED_DATA.exists()
                                                   else REPO / "examples" / "data" / "alpaca_sample.json"))
    parser.add_argument("--model_max_length", type=int, default=None,
                        help="truncate every example to this many tokens: each rank's activations are then about "
                             "the same at every number of processes, which otherwise draw different examples")
    parser.add_argument("--poll_s", type=float, default=0.05, help="how often each rank's memory is read")
    return parser.parse_args()


def build_random_model(directory: Path, config: dict) -> Path:
    """A random Llama of `config` in bfloat16 safetensors, with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from alpaca.model import embedded_model_dir

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(LlamaConfig(**config, initializer_range=0.02)).to(torch.bfloat16)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(directory)
    return directory


def one_copy_bytes(model_dir: Path, dtype_bytes: int = 4) -> int:
    """Parameter bytes of the whole base in the training dtype (float32), from the safetensors headers."""
    from safetensors import safe_open

    numel = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as opened:
            for name in opened.keys():
                numel += math.prod(opened.get_slice(name).get_shape())
    return numel * dtype_bytes


def early_layers_on_disk(model_dir: Path, first_intervened: int) -> str:
    """A JSON --device_map of a Llama-layout model: the decoder layers before `first_intervened` on disk (no
    gradient flows through them: their weights are dropped after their forward), the rest on the CPU."""
    config = json.loads((model_dir / "config.json").read_text())
    placed = {f"model.layers.{i}": "disk" if i < first_intervened else "cpu"
              for i in range(config["num_hidden_layers"])}
    return json.dumps({"model.embed_tokens": "cpu", **placed, "model.norm": "cpu", "model.rotary_emb": "cpu",
                       "lm_head": "cpu"})


def bytes_per_quantized_parameter(model_dir: Path, strategy: str) -> float:
    """What bitsandbytes holds per parameter of the linear layers it quantizes (values and constants)."""
    import torch

    from alpaca.model import load_base_model
    from alpaca.strategy import local_parameter_bytes

    model, _ = load_base_model(str(model_dir), torch.float32, torch.device("cpu"), quantization=QUANTIZED[strategy])
    import bitsandbytes as bnb  # once it has loaded, which quiets bitsandbytes' import-time warning

    quantized = [module for module in model.modules() if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    return (sum(local_parameter_bytes(module) for module in quantized)
            / sum(module.in_features * module.out_features for module in quantized))


def status_kib(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # the process has exited
        return {}
    return {key: int(value.split()[0]) for key, value in re.findall(r"^(VmHWM|RssAnon):\s+(.+)$", text, re.M)}


def workers(launcher_pid: int) -> dict[int, int]:
    """The launcher's children that are training ranks: {pid: rank}."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        ranks = [item[5:] for item in environ if item.startswith(b"RANK=")]
        if ranks:
            found[int(entry)] = int(ranks[0])
    return found


def measure(model_dir: Path, strategy: str, nproc: int, args: argparse.Namespace, layers: str) -> list[dict]:
    """One training run; per rank: peak VmHWM and RssAnon (bytes), its base parameter bytes in memory and its
    tokens/s."""
    with tempfile.TemporaryDirectory(prefix="memory-") as output_dir:
        placement = STRATEGIES[strategy]
        if strategy == "disk":
            placement = [*placement, "--max_memory", json.dumps({"cpu": one_copy_bytes(model_dir) // 2})]
        if strategy == "disk_early":
            placement = ["--device_map", early_layers_on_disk(model_dir, int(layers.split(";")[0]))]
        if strategy.startswith("disk"):
            placement += ["--offload_folder", str(Path(output_dir) / "offload")]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   str(REPO / "train_multigpu.py"), "--model_name_or_path", str(model_dir), "--data_path",
                   args.data_path, "--output_dir", output_dir, "--max_steps", str(args.steps),
                   "--per_device_train_batch_size", "1", "--max_n_train_example", "64", "--layers", layers,
                   "--num_sample_answers", "0", "--logging_steps", "1", "--dtype", "float32",
                   *(["--model_max_length", str(args.model_max_length)] if args.model_max_length else []),
                   *placement]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
        launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        peaks: dict[int, dict[str, int]] = {}
        ranks: dict[int, int] = {}
        while launcher.poll() is None:
            if len(ranks) < nproc:
                ranks.update(workers(launcher.pid))
            for pid in ranks:
                for key, kib in status_kib(pid).items():
                    peaks.setdefault(pid, {})[key] = max(peaks.get(pid, {}).get(key, 0), kib)
            time.sleep(args.poll_s)
        output = launcher.stdout.read()
        if launcher.returncode != 0:
            raise SystemExit(f"{strategy} on {nproc} processes failed:\n{output[-3000:]}")
        # The last line of train_multigpu.py's report: "rank r: ... tok/s, peak ... GiB, base X MiB".
        reported = {int(r): (float(t), float(b)) for r, t, b in re.findall(
            r"rank (\d+): ([\d.]+) tok/s, peak [\d.]+ GiB, base ([\d.]+) MiB", output)}
    by_rank = {rank: peaks.get(pid, {}) for pid, rank in ranks.items()}
    return [dict(rank=rank, hwm=by_rank[rank].get("VmHWM", 0) * 1024, anon=by_rank[rank].get("RssAnon", 0) * 1024,
                 params=reported.get(rank, (0, float("nan")))[1] * 2**20,
                 tokens_per_s=reported.get(rank, (float("nan"),))[0]) for rank in sorted(by_rank)]


def main() -> None:
    args = parse_args()
    from alpaca.model import embedded_model_dir

    with tempfile.TemporaryDirectory(prefix="memory-model-") as scratch:
        models = {}
        if "smollm2" in args.models:
            models["SmolLM2-135M"] = (embedded_model_dir(), "8;19")
        for name in [name for name in args.models if name in RANDOM_MODELS]:
            print(f"Building the {name} model ...", flush=True)
            config, layers = RANDOM_MODELS[name]
            model_dir = build_random_model(Path(scratch) / name, config)
            models[f"{name} {one_copy_bytes(model_dir) / 4e9:.2f}B (bf16 file)"] = (model_dir, layers)
        rows = []
        for model_name, (model_dir, layers) in models.items():
            copy = one_copy_bytes(model_dir)
            print(f"\n{model_name}: one copy = {copy / 2**30:.2f} GiB (float32)\n"
                  f"{'processes':>9} {'strategy':>8} | {'peak RSS (VmHWM) per rank':>34} | "
                  f"{'peak anonymous RSS per rank':>34} | {'base params per rank':>28} | tokens/s per rank", flush=True)
            for nproc in args.nproc:
                for strategy in args.strategies:
                    ranks = measure(model_dir, strategy, nproc, args, layers)

                    def cells(key, ranks=ranks, copy=copy):
                        figures = [r[key] for r in ranks]
                        return (" / ".join(f"{f / 2**30:.2f}" for f in figures) + " GiB ("
                                + " / ".join(f"{f / copy:.2f}" for f in figures) + "x)")

                    rates = " / ".join(f"{r['tokens_per_s']:.0f}" for r in ranks)
                    print(f"{nproc:>9} {strategy:>8} | {cells('hwm'):>34} | {cells('anon'):>34} | "
                          f"{cells('params'):>28} | {rates}", flush=True)
                    rows.append(dict(model=model_name, nproc=nproc, strategy=strategy, one_copy=copy, ranks=ranks))
            for nproc in args.nproc:  # the sharded 4-bit base against DDP's whole 4-bit copy per rank
                held = {row["strategy"]: max(rank["params"] for rank in row["ranks"]) for row in rows
                        if row["model"] == model_name and row["nproc"] == nproc}
                if {"nf4", "fsdp_nf4"} <= held.keys():
                    print(f"fsdp_nf4 on {nproc} processes: {held['fsdp_nf4'] / held['nf4']:.3f}x the base parameter "
                          "bytes per rank of nf4 (DDP)", flush=True)
            for strategy in [name for name in QUANTIZED if name in args.strategies]:
                print(f"{strategy}: {bytes_per_quantized_parameter(model_dir, strategy):.4f} bytes per quantized "
                      "parameter", flush=True)
        print("\n" + json.dumps(rows))


if __name__ == "__main__":
    main()
