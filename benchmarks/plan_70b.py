"""Time and host memory of a 70B plan: the Llama-3.1-70B shapes (a config.json written here, nothing else) planned at
world size 8 with --fsdp, `train_multigpu.py --plan`, in one process on this machine's CPU.

    python benchmarks/plan_70b.py [--plan 8x80GB] [-- more train_multigpu.py flags]

Prints the plan, then its wall time and the process's peak resident memory (VmHWM, by getrusage of the child).
"""

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import LlamaConfig

REPO = Path(__file__).resolve().parent.parent
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                 tie_word_embeddings=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="8x80GB")
    parser.add_argument("flags", nargs="*", help="more train_multigpu.py flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        model = Path(directory) / "llama-3.1-70b-shapes"
        LlamaConfig(**LLAMA_70B).save_pretrained(model)
        command = [sys.executable, str(REPO / "train_multigpu.py"), "--model_name_or_path", str(model), "--fsdp",
                   "--layers", "8;19", "--plan", args.plan, "--output_dir", str(Path(directory) / "out"), *args.flags]
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"the plan failed (exit {result.returncode}): {result.stderr.strip().splitlines()[-1]}")
    print(result.stdout.strip())
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(f"70B plan at world size 8 (--fsdp --plan {args.plan}): {seconds:.0f} s wall, "
          f"{peak_rss / 2**30:.2f} GiB peak resident host memory")


if __name__ == "__main__":
    main()
