"""Answers of the base model and of a trained ReFT model side by side (or of two trained runs: --compare).

    python examples/generate.py --reft_dir output
    python examples/generate.py --reft_dir out --instruction "Name three primary colors." --max_new_tokens 64
    python examples/generate.py --reft_dir single_gpu_run --compare multi_gpu_run --instructions_file prompts.txt
    python examples/generate.py --reft_dir chat_run --conversations_file chats.jsonl   # --prompt_template chat runs
    python examples/generate.py --reft_dir big_run --device_map auto --offload_folder offload   # a base > one GPU
    python examples/generate.py --reft_dir qreft_run --load_in_4bit     # on a 4-bit base, as it trained (QReFT)

The base model (unless given), the intervention positions and the prompt template come from the run's
training_args.json. Greedy decoding; the interventions act on the prompt's positions, as in training.
--device_map, --max_memory and --offload_folder place the base as in training (over every visible GPU, the CPU
and disk; docs/big-models.md), each intervention on its layer's device; the answers are those of one device.
--load_in_4bit and --load_in_8bit quantize the base as it loads (bitsandbytes), as training's flags do: a run
trained on a quantized base answers on it, or on the full-precision base without them, and so does any other.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`

from alpaca.args import (
    UsageParser,
    add_device_map_flags,
    add_quantization_flags,
    exit_on_usage_error,
    quantization_settings,
    validate_device_map,
    validate_quantization,
)
from alpaca.errors import UsageError
from alpaca.flag_values import parse_position

PROG = "generate.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = UsageParser(prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--reft_dir", required=True, help="a training output_dir (or a checkpoint-<step> in it)")
    parser.add_argument("--compare", default=None, help="a second output_dir: its answers replace the base's")
    parser.add_argument("--model_name_or_path", default=None, help="default: the one the run trained on")
    parser.add_argument("--instruction", action="append", default=[], help="repeatable")
    parser.add_argument("--instructions_file", default=None, help="one instruction per line")
    parser.add_argument("--conversations_file", default=None,
                        help="conversations to continue (a run trained with --prompt_template chat): .json/.jsonl "
                             "records of 'messages', each ending with the user's turn")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add_device_map_flags(parser.add_argument_group("placement, for a base one device cannot hold (as in training)"))
    add_quantization_flags(parser.add_argument_group("quantization of the base (as in training)"))
    args = parser.parse_args(argv)
    try:
        validate_quantization(args)
        validate_device_map(args)
    except UsageError as error:
        exit_on_usage_error(PROG, error)
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before the heavy imports below
    ARGS = parse_args()

import torch

from alpaca.data import check_conversations, read_local_records
from alpaca.device_map import DeviceMap
from alpaca.generation import SAMPLE_INSTRUCTIONS, answer, side_by_side
from alpaca.model import load_base_model, num_intervened_layers, resolve_dtype
from alpaca.output import ARGS_FILE, load_reft_model

RUN_SETTINGS = ("model_name_or_path", "position", "share_weights", "prompt_template")


def run_settings(directory: str) -> dict:
    """The flags a run was trained with (training_args.json, in the output_dir or next to a checkpoint)."""
    path = Path(directory)
    for candidate in (path / ARGS_FILE, path.parent / ARGS_FILE):
        if candidate.exists():
            settings = json.loads(candidate.read_text())
            missing = [name for name in RUN_SETTINGS if name not in settings]
            if missing:
                raise UsageError(f"{str(candidate)!r} records no {', '.join(missing)}: it was not written by this "
                                 "train.py; train the run again")
            return settings
    raise UsageError(f"{directory!r} has no training_args.json; pass an output_dir written by train.py")


def read_conversations(path: str) -> list[list[dict]]:
    """The messages of each record of a .json/.jsonl file of conversations, each ending with the user's turn."""
    records = read_local_records(path, "--conversations_file")
    check_conversations(records, f"--conversations_file {path!r}", last_role="user")
    return [record["messages"] for record in records]


def main(args: argparse.Namespace) -> None:
    try:
        generate(args)
    except UsageError as error:
        exit_on_usage_error(PROG, error)


def generate(args: argparse.Namespace) -> None:
    runs = [args.reft_dir] + ([args.compare] if args.compare else [])
    settings = [run_settings(run) for run in runs]
    instructions = list(args.instruction)
    if args.instructions_file:
        instructions += [line.strip() for line in Path(args.instructions_file).read_text().splitlines() if line.strip()]
    if args.conversations_file:
        instructions += read_conversations(args.conversations_file)
    instructions = instructions or SAMPLE_INSTRUCTIONS
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    # A device map spreads the base over every visible GPU (and the CPU, disk), as train.py's does.
    gpus = list(range(torch.cuda.device_count()))
    device_map = (None if args.device_map is None
                  else DeviceMap(args.device_map, args.max_memory, args.offload_folder, gpus))
    model, tokenizer = load_base_model(args.model_name_or_path or settings[0]["model_name_or_path"],
                                       resolve_dtype(args.dtype, device), device, device_map=device_map,
                                       quantization=quantization_settings(args))
    if device_map is not None:
        print(f"Base model on --device_map ({device_map.describe(model)})")
    answers = []
    for run, run_args in zip(runs, settings):
        reft_model = load_reft_model(run, model)
        if device_map is not None:
            device_map.place(reft_model)
        position = parse_position(run_args["position"])
        num_layers = num_intervened_layers(reft_model, position, run_args["share_weights"])
        prompt_template = run_args["prompt_template"]
        if args.conversations_file and prompt_template != "chat":
            raise UsageError(f"--conversations_file: {run!r} was trained with --prompt_template {prompt_template}; "
                             "conversations need a run trained with --prompt_template chat")
        answers.append([answer(reft_model, tokenizer, instruction, position, run_args["share_weights"], num_layers,
                               args.max_new_tokens, prompt_template=prompt_template) for instruction in instructions])
    if args.compare:
        rows = [(i, first[1], second[1]) for i, first, second in zip(instructions, *answers)]
        print(side_by_side(rows, headers=(args.reft_dir, args.compare)))
    else:
        print(side_by_side([(i, *pair) for i, pair in zip(instructions, answers[0])]))


if __name__ == "__main__":
    main(ARGS)
