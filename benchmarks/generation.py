"""Answers per second: examples/generate.py's batched answers file against the one-at-a-time loop.

    python benchmarks/generation.py                                   # SmolLM2-135M, CPU: batch 1, 8, 16, 32
    python benchmarks/generation.py --reft_dir out --num_prompts 256 --batch_sizes 1,32,64 --dtype bfloat16  # GPU

Both sides answer the same --num_prompts held-out instructions of the shipped sample (repeated if there are fewer)
with the same run, greedy, up to --max_new_tokens tokens each (an answer ends at eos on both sides; a batch runs
until its last row has ended), in float32 unless --dtype says otherwise. Each measurement is a whole process, timed
from its start to its exit (imports and the model's load included, as a user waits for them), repeated
--repeats times; the table gives the median and the range.
  one-at-a-time  the loop a researcher writes first (and generate.py ran before --output_file): each prompt alone
                 through pyvene's generate, the interventions on its prompt, the KV cache after it
  batch B        python examples/generate.py --output_file ... --per_device_batch_size B
Without --reft_dir, a run of 2 training steps is made first (its interventions' values do not change the time).
On a CPU that other jobs share, run it with OMP_NUM_THREADS=1 (as torchrun runs each process): OpenMP threads
that wait for each other on busy cores make every variant several times slower, and the figures noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SAMPLE = REPO / "examples" / "data" / "alpaca_sample.json"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reft_dir", default=None, help="a training output_dir; default: 2 steps on SmolLM2-135M")
    parser.add_argument("--num_prompts", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--batch_sizes", default="1,8,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--one_at_a_time", default=None, help=argparse.SUPPRESS)  # the baseline's own process
    return parser.parse_args()


def one_at_a_time(args: argparse.Namespace) -> None:
    """The baseline's process: load as generate.py does, then answer each prompt alone."""
    import torch

    from alpaca.collate import intervention_locations
    from alpaca.data import format_prompt
    from alpaca.flag_values import parse_position
    from alpaca.model import load_base_model, num_intervened_layers
    from alpaca.output import load_reft_model

    settings = json.loads((Path(args.reft_dir) / "training_args.json").read_text())
    model, tokenizer = load_base_model(settings["model_name_or_path"], getattr(torch, args.dtype), torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"))
    reft_model = load_reft_model(args.reft_dir, model)
    position = parse_position(settings["position"])
    num_layers = num_intervened_layers(reft_model, position, settings["share_weights"])
    answers = []
    for record in json.loads(Path(args.one_at_a_time).read_text()):
        prompt = tokenizer(format_prompt(record["instruction"], record["input"]), return_tensors="pt").to(model.device)
        locations = intervention_locations([prompt["input_ids"].shape[1]], position, settings["share_weights"],
                                           num_layers, pad_position=None)
        with torch.no_grad():
            _, output = reft_model.generate(dict(prompt), unit_locations={"sources->base": (None, locations)},
                                            intervene_on_prompt=True, max_new_tokens=args.max_new_tokens,
                                            do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                            pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True))
    print(f"{len(answers)} answers")


def timed(command: list[str]) -> float:
    """Seconds from the process's start to its exit."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.one_at_a_time:
        return one_at_a_time(args)
    work = Path(tempfile.mkdtemp(prefix="generation-benchmark-"))
    if args.reft_dir is None:
        args.reft_dir = str(work / "run")
        timed([sys.executable, "train.py", "--output_dir", args.reft_dir, "--max_steps", "2",
               "--num_sample_answers", "0"])
    held_out = json.loads(SAMPLE.read_text())[-20:]
    prompts = [held_out[index % len(held_out)] for index in range(args.num_prompts)]
    (work / "prompts.json").write_text(json.dumps(prompts))
    common = ["--reft_dir", args.reft_dir, "--max_new_tokens", str(args.max_new_tokens), "--dtype", args.dtype]
    variants = {"one-at-a-time": [sys.executable, __file__, "--one_at_a_time", str(work / "prompts.json"), *common]}
    for size in args.batch_sizes.split(","):
        variants[f"batch {size}"] = [sys.executable, "examples/generate.py", "--instructions_file",
                                     str(work / "prompts.json"), "--output_file", str(work / f"answers-{size}.json"),
                                     "--per_device_batch_size", size, *common]
    seconds = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, so that a change in the machine's load falls on every variant
        for name, command in variants.items():
            seconds[name].append(timed(command))
    baseline = statistics.median(seconds["one-at-a-time"])
    print(f"{args.num_prompts} prompts, {args.max_new_tokens} new tokens each, {args.dtype}, {args.repeats} repeats "
          f"of each whole process ({args.reft_dir})")
    print("| variant | seconds, median (range) | answers/s | speed-up |\n|---|---|---|---|")
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"| {name} | {median:.1f} ({min(times):.1f}–{max(times):.1f}) | {args.num_prompts / median:.2f} | "
              f"{baseline / median:.2f}× |")


if __name__ == "__main__":
    main()
