"""What a 4-bit base costs in quality (QReFT): held-out eval loss of the base, of ReFT trained on the full-precision
base and of ReFT trained on the NF4 base (each on the base it trained on), and of the NF4-trained interventions on
the full-precision base; with each training run's tokens/s and peak resident memory (VmHWM).

    python benchmarks/quality.py                                  # SmolLM2, the shipped Alpaca records, a few min
    python benchmarks/quality.py --max_steps 100 --train_examples 800

Each training run is a real `train.py` run (float32 compute, the same seed, data and flags, only --load_in_4bit
differs). The eval losses are computed here, per output token over the same held-out records, by the scripts' own
evaluation (alpaca.loss.evaluate) on the interventions as saved, loaded with alpaca.output.load_reft_model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SHARED_DATA = REPO.parent / "shared" / "data" / "alpaca_en_demo.json"
NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_path", default=str(SHARED_DATA))
    parser.add_argument("--train_examples", type=int, default=256, help="the first N records train")
    parser.add_argument("--eval_examples", type=int, default=48, help="the last N records are held out")
    parser.add_argument("--max_steps", type=int, default=16)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--model_max_length", type=int, default=256)
    parser.add_argument("--layers", default="8;19")
    return parser.parse_args()


def train(name: str, quantized: list[str], data: Path, eval_data: Path, output_dir: Path,
          args: argparse.Namespace) -> dict:
    """One train.py run; its tokens/s and peak resident memory, from its last report line."""
    command = [sys.executable, str(REPO / "train.py"), "--data_path", str(data), "--eval_data_path", str(eval_data),
               "--output_dir", str(output_dir), "--max_steps", str(args.max_steps), "--per_device_train_batch_size",
               str(args.per_device_train_batch_size), "--model_max_length", str(args.model_max_length),
               "--layers", args.layers, "--num_sample_answers", "0", "--logging_steps", "4", "--dtype", "float32",
               *quantized]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"})
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    tokens_per_s, peak = re.search(r"\((\d+) tokens/s, peak memory ([\d.]+) GiB resident\)", result.stdout).groups()
    return {"tokens_per_s": float(tokens_per_s), "peak_gib": float(peak)}


class BaseOnly:
    """The base model where alpaca.loss.evaluate expects a ReFT model: no interventions."""

    def __init__(self, model) -> None:
        import torch

        self.model, self.interventions = model, torch.nn.ModuleDict()

    def __call__(self, inputs: dict, unit_locations=None):
        return None, self.model(**inputs)


def eval_loss(model, eval_records: Path, run_dir: Path | None, tokenizer, args: argparse.Namespace) -> float:
    """Per-token loss on the held-out records: of `model` alone, or with the interventions saved in `run_dir`."""
    import numpy as np
    import torch

    from alpaca.collate import Collator
    from alpaca.data import load_records, prepare_dataset
    from alpaca.flag_values import parse_position
    from alpaca.loss import evaluate
    from alpaca.model import num_intervened_layers
    from alpaca.output import load_reft_model
    from alpaca.sampler import eval_batches

    position = parse_position("f1+l1")
    dataset = prepare_dataset(load_records(str(eval_records)), tokenizer, args.model_max_length)
    reft_model = BaseOnly(model) if run_dir is None else load_reft_model(run_dir, model)
    num_layers = len(args.layers.split(";")) if run_dir is None else num_intervened_layers(reft_model, position, False)
    collate = Collator(tokenizer.pad_token_id, position, False, num_layers)
    loss_sum, label_tokens = evaluate(reft_model, dataset, eval_batches(np.array(dataset["length"]), 8), collate,
                                      torch.device("cpu")).tolist()
    return loss_sum / label_tokens


def main() -> None:
    args = parse_args()
    import torch

    from alpaca.model import embedded_model_dir, load_base_model

    records = json.loads(Path(args.data_path).read_text())
    with tempfile.TemporaryDirectory(prefix="quality-") as scratch:
        scratch = Path(scratch)
        (scratch / "train.json").write_text(json.dumps(records[: args.train_examples]))
        (scratch / "eval.json").write_text(json.dumps(records[-args.eval_examples :]))
        runs = {}
        for name, quantized in (("full", []), ("nf4", ["--load_in_4bit"])):
            print(f"training on the {name} base ...", flush=True)
            runs[name] = train(name, quantized, scratch / "train.json", scratch / "eval.json", scratch / name, args)
        model_dir, held_out = str(embedded_model_dir()), scratch / "eval.json"
        full, tokenizer = load_base_model(model_dir, torch.float32, torch.device("cpu"))
        nf4, _ = load_base_model(model_dir, torch.float32, torch.device("cpu"), quantization=NF4)
        losses = {
            "base (float32)": eval_loss(full, held_out, None, tokenizer, args),
            "base (NF4)": eval_loss(nf4, held_out, None, tokenizer, args),
            "ReFT trained on the float32 base, on it": eval_loss(full, held_out, scratch / "full", tokenizer, args),
            "ReFT trained on the NF4 base, on it": eval_loss(nf4, held_out, scratch / "nf4", tokenizer, args),
            "ReFT trained on the NF4 base, on the float32 base": eval_loss(full, held_out, scratch / "nf4", tokenizer,
                                                                           args),
        }
    print(f"\nSmolLM2-135M-Instruct, {args.train_examples} training records, {args.max_steps} steps of "
          f"{args.per_device_train_batch_size}, {args.eval_examples} held-out records (eval loss per output token)")
    for name, loss in losses.items():
        print(f"  {name:<52} {loss:.4f}")
    for name, run in runs.items():
        print(f"  training on the {name} base: {run['tokens_per_s']:.0f} tokens/s, peak resident {run['peak_gib']:.2f} "
              "GiB")
    print("\n" + json.dumps({"eval_loss": losses, "training": runs}))


if __name__ == "__main__":
    main()
