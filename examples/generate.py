"""Answers of a trained ReFT model: a file of them to score (AlpacaEval's format), batched, on 1 or N processes;
or the base model's and the ReFT model's side by side (or two trained runs': --compare) for a few instructions.

    python examples/generate.py --reft_dir out --instructions_file eval.json --output_file answers.json
    torchrun --nproc_per_node 8 examples/generate.py --reft_dir out --instructions_file eval.json \\
        --output_file answers.json --per_device_batch_size 32          # the same file, from 8 GPUs
    python examples/generate.py ... --output_file answers.json --resume  # after a kill: the answers left
    python examples/generate.py --reft_dir out --held_out --output_file held_out_answers.json  # --eval_split_ratio's
    python examples/generate.py --reft_dir out --instructions_file eval.json --output_file base.json --base
    python examples/generate.py --reft_dir output                        # side by side, 3 held-out instructions
    python examples/generate.py --reft_dir out --instruction "Name three primary colors." --max_new_tokens 64
    python examples/generate.py --reft_dir single_gpu_run --compare multi_gpu_run --instructions_file prompts.txt
    python examples/generate.py --reft_dir chat_run --conversations_file chats.jsonl   # --prompt_template chat runs
    python examples/generate.py --reft_dir big_run --device_map auto --offload_folder offload   # a base > one GPU
    python examples/generate.py --reft_dir qreft_run --load_in_4bit     # on a 4-bit base, as it trained (QReFT)

The base model (unless given), the intervention positions, the prompt template and --model_max_length come from
the run's training_args.json; the interventions act on the prompt's positions, as in training. Greedy unless
--do_sample. --instructions_file: what training reads (Alpaca records, `messages` or ShareGPT conversations) or a
JSON list of instructions, as .json/.jsonl; any other file: one instruction a line. A conversation ending with the
assistant's turn is answered from the turns before it; that turn, like an Alpaca record's output, is written as the
answer's `reference`. --held_out: the records the run held out (--eval_split_ratio), which it wrote to held_out.jsonl.
With --output_file every process answers its share in left-padded batches (the same batches on 1 and N
processes), appending them to OUTPUT.partial/ as they finish; process 0 writes the answers in input order and
OUTPUT's summary (.summary.json). --device_map, --max_memory and --offload_folder place the base as in training
(docs/big-models.md); --load_in_4bit and --load_in_8bit quantize it as it loads, as training's flags do.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`

from alpaca.args import UsageParser, add_device_map_flags, exit_on_usage_error, validate_device_map
from alpaca.errors import UsageError
from alpaca.flag_values import parse_position
from alpaca.quantization_flags import add_quantization_flags, quantization_settings, validate_quantization
from alpaca.versions import check_torch

PROG = "generate.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = UsageParser(prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--reft_dir", required=True, help="a training output_dir (or a checkpoint-<step> in it)")
    parser.add_argument("--compare", default=None, help="a second output_dir: its answers replace the base's")
    parser.add_argument("--model_name_or_path", default=None, help="default: the one the run trained on")
    parser.add_argument("--instruction", action="append", default=[], help="repeatable")
    parser.add_argument("--instructions_file", default=None,
                        help="records to answer: .json/.jsonl of Alpaca records, conversations or instructions; "
                             "else one instruction per line")
    parser.add_argument("--held_out", action="store_true",
                        help="answer the records the run held out (--eval_split_ratio): its held_out.jsonl")
    parser.add_argument("--conversations_file", default=None,
                        help="conversations to continue (a run trained with --prompt_template chat): .json/.jsonl "
                             "records of 'messages', each ending with the user's turn")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    scoring = parser.add_argument_group("a file of answers to score (AlpacaEval's format)")
    scoring.add_argument("--output_file", default=None, help="write the answers here, as a JSON list")
    scoring.add_argument("--per_device_batch_size", type=int, default=8, help="prompts a batch, on each process")
    scoring.add_argument("--base", action="store_true", help="the base model's answers (no interventions)")
    scoring.add_argument("--generator_name", default=None,
                         help="the answers' `generator` (default: the run directory's name, + '-base' with --base)")
    scoring.add_argument("--resume", action="store_true", help="answer only what OUTPUT.partial/ lacks")
    scoring.add_argument("--model_max_length", type=int, default=None,
                         help="longer prompts are cut, as in training (default: the run's)")
    scoring.add_argument("--ddp_timeout", type=int, default=1800,
                         help="under torchrun, seconds a process may wait for the others: raise it where one "
                              "process's share of the batches can take that much longer than another's")
    decoding = parser.add_argument_group("decoding (greedy by default)")
    decoding.add_argument("--repetition_penalty", type=float, default=None)
    decoding.add_argument("--no_repeat_ngram_size", type=int, default=None)
    decoding.add_argument("--do_sample", action="store_true")
    decoding.add_argument("--temperature", type=float, default=None)
    decoding.add_argument("--top_p", type=float, default=None)
    decoding.add_argument("--seed", type=int, default=42,
                          help="with --do_sample: the same answers on 1 and N processes")
    add_device_map_flags(parser.add_argument_group("placement, for a base one device cannot hold (as in training)"))
    add_quantization_flags(parser.add_argument_group("quantization of the base (as in training)"))
    args = parser.parse_args(argv)
    try:
        check_torch()
        validate_quantization(args)
        validate_device_map(args)
        validate_generation(args)
    except UsageError as error:
        exit_on_usage_error(PROG, error)
    return args


def validate_generation(args: argparse.Namespace) -> None:
    if args.held_out and args.instructions_file:
        raise UsageError("--held_out and --instructions_file both name the records to answer; give one")
    if args.output_file is None:
        given = next((flag for flag in ("base", "resume", "generator_name") if getattr(args, flag)), None)
        if given:
            raise UsageError(f"--{given} applies to a file of answers; add --output_file FILE")
    elif args.compare:
        raise UsageError("--compare prints two runs side by side; write each run's --output_file instead")
    elif not (args.instructions_file or args.held_out):
        raise UsageError("--output_file needs --instructions_file (or --held_out): the records to answer")
    elif args.instruction or args.conversations_file:
        given = "--instruction" if args.instruction else "--conversations_file"
        raise UsageError(f"--output_file answers the records of one file; {given} would be left out: put its "
                         "records in the --instructions_file")
    if args.per_device_batch_size < 1 or args.max_new_tokens < 1:
        raise UsageError("--per_device_batch_size and --max_new_tokens must be 1 or more")
    if args.ddp_timeout < 1:
        raise UsageError("--ddp_timeout must be a positive number of seconds")
    if not args.do_sample and (args.temperature is not None or args.top_p is not None):
        raise UsageError("--temperature and --top_p apply to sampling; add --do_sample")


if __name__ == "__main__":  # --help and usage errors answer here, before the heavy imports below
    ARGS = parse_args()

import gc
import hashlib
import json
import os
import shutil

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from alpaca.checkpoint import step_of
from alpaca.constants import CONVERSATION_FIELD, HELD_OUT_FILE
from alpaca.data import check_conversation, check_conversations, read_local_records
from alpaca.data_source import data_file_loader
from alpaca.device_map import DeviceMap, local_rank_gpus
from alpaca.distributed import let_go_of_process_group, main_rank_result, run_checked, start_process_group
from alpaca.generation import (
    SAMPLE_INSTRUCTIONS,
    answer,
    decode_answers,
    generate_batch,
    prompt_ids,
    side_by_side,
    summary,
)
from alpaca.launcher_env import launched_alone_as_world_of_one
from alpaca.model import load_base_model, num_intervened_layers, resolve_dtype
from alpaca.output import ARGS_FILE, load_reft_model, quiet_non_main_rank

RUN_SETTINGS = ("model_name_or_path", "position", "share_weights", "prompt_template", "model_max_length")


def run_directory(reft_dir: str) -> Path:
    """Return the output_dir of the run --reft_dir names: itself, or the parent of a checkpoint-<step>."""
    return Path(reft_dir).parent if step_of(Path(reft_dir)) >= 0 else Path(reft_dir)


def run_settings(directory: str) -> dict:
    """Read the flags a run was trained with: the training_args.json of `directory`, or of its run (run_directory)."""
    path = next((path for path in (Path(directory) / ARGS_FILE, run_directory(directory) / ARGS_FILE)
                 if path.is_file()), None)
    if path is None:
        problem = "has no " + ARGS_FILE if Path(directory).is_dir() else "does not exist: there is no such run"
        raise UsageError(f"--reft_dir {directory!r} {problem}; pass an output_dir written by train.py (or a "
                         "checkpoint-<step> in it)")
    settings = json.loads(path.read_text())
    missing = [name for name in RUN_SETTINGS if name not in settings]
    if missing:
        raise UsageError(f"{str(path)!r} records no {', '.join(missing)}: it was not written by this train.py; "
                         "train the run again")
    return settings


def held_out_file(reft_dir: str) -> Path:
    """Return the held_out.jsonl the run --reft_dir names wrote (--eval_split_ratio), and only that run's: not a file
    of that name further up (a user's own, another run's)."""
    run = run_directory(reft_dir)
    ratio = run_settings(str(run)).get("eval_split_ratio")
    if ratio is None:
        raise UsageError(f"--held_out: the run {str(run)!r} was trained without --eval_split_ratio, so it held no "
                         "records out; pass the records to answer as --instructions_file, or train with "
                         "--eval_split_ratio 0.05")
    if not (run / HELD_OUT_FILE).is_file():
        raise UsageError(f"--held_out: the run {str(run)!r} was trained with --eval_split_ratio {ratio} by a "
                         f"train.py from before it wrote the held-out records to {HELD_OUT_FILE}; train it again, "
                         "or pass those records as --instructions_file")
    return run / HELD_OUT_FILE


def read_conversations(path: str) -> list[list[dict]]:
    """Read the messages of each record of a .json/.jsonl file of conversations, each ending with the user's turn."""
    records = read_local_records(path, "--conversations_file")
    check_conversations(records, f"--conversations_file {path!r}", last_role="user")
    return [record["messages"] for record in records]


def bare_instructions_listed(path: str) -> bool:
    """Tell whether `path` is a .json list with bare instructions (strings) in it, which datasets' json loader does not
    read: such a file is read whole here."""
    if not (Path(path).is_file() and path.lower().endswith(".json")):
        return False
    try:
        listed = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # datasets' loader says what is wrong with it
    return isinstance(listed, list) and any(isinstance(item, str) for item in listed)


def conversation_to_answer(messages, where: str) -> tuple[list[dict], dict | None]:
    """Return a conversation's turns to answer and the answer it holds. One that ends with the assistant's turn is one
    training takes (checked with training's words): it is answered from exactly the prompt training gives it, every
    turn before its last (whoever's: a tool's, an assistant's, a system prompt), and that last turn is its
    reference. Any other must end with the user's turn, and has no reference."""
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
            and messages[-1].get("role") == "assistant":
        check_conversation(messages, where)
        return messages[:-1], messages[-1]
    check_conversation(messages, where, ("assistant", "user"))
    return messages, None


def read_instructions(path: str, flag: str = "--instructions_file") -> list[dict]:
    """Read the records of `path` (the file of `flag`: --instructions_file, or --held_out's), in order, as
    {instruction, input, dataset, reference}: `instruction` a string or a conversation (conversation_to_answer);
    `reference` the answer the record holds (an Alpaca record's output, a conversation's last turn where it is the
    assistant's), else None. Read as training reads its records (any container and record format --data_path
    takes); a file of another kind (.txt) holds one instruction a line. A fault names the record's index in the
    file."""
    if bare_instructions_listed(path):
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    elif not Path(path).is_file() or data_file_loader(path):
        records = read_local_records(path, flag)
    else:
        try:
            records = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read {flag} {path!r}: {error}") from None
    source = f"{flag} {path!r}"
    items = []
    for index, record in enumerate(records):
        if isinstance(record, str):
            record = {"instruction": record}
        if isinstance(record, dict) and CONVERSATION_FIELD in record:
            turns, reference = conversation_to_answer(record[CONVERSATION_FIELD], f"record {index} of {source}")
            record = {**record, "instruction": turns, "input": "", "output": reference and reference["content"]}
        elif not (isinstance(record, dict) and isinstance(record.get("instruction"), str)
                  and all(isinstance(record.get(field) or "", str) for field in ("input", "output"))):
            raise UsageError(f"record {index} of {source} is neither an instruction, a record with a string "
                             "'instruction' (and optionally 'input' and 'output') nor a conversation")
        items.append({"instruction": record["instruction"], "input": record.get("input") or "",
                      "dataset": record.get("dataset") or Path(path).stem, "reference": record.get("output")})
    if not items:
        raise UsageError(f"{source} holds no records")
    return items


def records_flag(args: argparse.Namespace) -> str:
    """Return the flag that named the file of records to answer, as its errors name it."""
    return "--held_out" if args.held_out else "--instructions_file"


def main(args: argparse.Namespace) -> None:
    try:
        if args.held_out:
            args.instructions_file = str(held_out_file(args.reft_dir))
        if args.output_file:
            answer_file_in_process_group(args)
        else:
            generate(args)
    except UsageError as error:
        exit_on_usage_error(PROG, error)


def load_models(args, settings: dict, device: torch.device, gpus: list[int]):
    """Load the base model (placed and quantized as the flags say) and its tokenizer, with the device map if any."""
    # A device map spreads the base over the process's GPUs (and the CPU, disk), as train.py's does.
    device_map = (None if args.device_map is None
                  else DeviceMap(args.device_map, args.max_memory, args.offload_folder, gpus))
    model, tokenizer = load_base_model(args.model_name_or_path or settings["model_name_or_path"],
                                       resolve_dtype(args.dtype, device), device, device_map=device_map,
                                       quantization=quantization_settings(args))
    if device_map is not None:
        print(f"Base model on --device_map ({device_map.describe(model)})")
    return model, tokenizer, device_map


def generate(args: argparse.Namespace) -> None:
    """Print the side-by-side view: each instruction's base and ReFT answers (or two runs' ReFT answers)."""
    runs = [args.reft_dir] + ([args.compare] if args.compare else [])
    settings = [run_settings(run) for run in runs]
    items = [{"instruction": instruction, "input": ""} for instruction in args.instruction]
    if args.instructions_file:
        items += read_instructions(args.instructions_file, records_flag(args))
    if args.conversations_file:
        items += [{"instruction": messages, "input": ""} for messages in read_conversations(args.conversations_file)]
    items = items or [{"instruction": instruction, "input": ""} for instruction in SAMPLE_INSTRUCTIONS]
    instructions = [item["instruction"] for item in items]
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model, tokenizer, device_map = load_models(args, settings[0], device, list(range(torch.cuda.device_count())))
    answers = []
    for run, run_args in zip(runs, settings):
        reft_model = load_reft_model(run, model)
        if device_map is not None:
            device_map.place(reft_model)
        position = parse_position(run_args["position"])
        num_layers = num_intervened_layers(reft_model, position, run_args["share_weights"])
        prompt_template = run_args["prompt_template"]
        if any(isinstance(i, list) for i in instructions) and prompt_template != "chat":
            raise UsageError(f"conversations: {run!r} was trained with --prompt_template {prompt_template}; "
                             "conversations need a run trained with --prompt_template chat")
        answers.append([answer(reft_model, tokenizer, item["instruction"], position, run_args["share_weights"],
                               num_layers, args.max_new_tokens, item["input"], prompt_template) for item in items])
    if args.compare:
        rows = [(i, first[1], second[1]) for i, first, second in zip(instructions, *answers)]
        print(side_by_side(rows, headers=(args.reft_dir, args.compare)))
    else:
        print(side_by_side([(i, *pair) for i, pair in zip(instructions, answers[0])]))


def answer_file_in_process_group(args: argparse.Namespace) -> None:
    """Run answer_file in a process group: this process's device, then the process group's life around it (a world of
    one under python)."""
    launched_alone_as_world_of_one()
    gpus = local_rank_gpus(PROG, device_map=args.device_map is not None) if torch.cuda.is_available() else []
    if gpus:
        torch.cuda.set_device(gpus[0])
    device = torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")
    # Only Python objects travel between the processes (answers, indices): gloo, on the host, whatever the device.
    start_process_group("gloo", args.ddp_timeout, device_id=None)
    try:
        answer_file(args, device, gpus)
    finally:  # however answering ends: what holds the group lets go of it, then it is destroyed
        let_go_of_process_group()
        dist.destroy_process_group()
        gc.collect()


# What decides the answers, besides the interventions, the records and the dtype as resolved: a resumed run must
# have the same.
DECODING = ("model_name_or_path", "base", "per_device_batch_size", "max_new_tokens", "model_max_length",
            "repetition_penalty", "no_repeat_ngram_size", "do_sample", "temperature", "top_p", "seed",
            "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")


def interventions_sha256(directory: str) -> str:
    """Hash the interventions' files in `directory` (config.json, intkey_*.bin): what they are, not where."""
    digest = hashlib.sha256()
    for path in sorted([*Path(directory).glob("intkey_*.bin"), Path(directory) / "config.json"]):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def answer_file(args: argparse.Namespace, host: torch.device, gpus: list[int]) -> None:
    """Write the answers of --instructions_file to --output_file. Every process: the records, the model and the batch
    plan; this process's share of the batches not yet answered, each appended to the partial directory as it finishes;
    then process 0 writes the file."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_main, cpu = rank == 0, torch.device("cpu")
    if not is_main:
        quiet_non_main_rank()
    settings = run_checked(lambda: run_settings(args.reft_dir), participate=True, device=cpu)
    items = run_checked(lambda: read_instructions(args.instructions_file, records_flag(args)), participate=True,
                        device=cpu)
    args.model_max_length = args.model_max_length or settings["model_max_length"]
    partial = Path(args.output_file + ".partial")
    records = hashlib.sha256(json.dumps(items).encode()).hexdigest()
    decoding = {name: getattr(args, name) for name in DECODING} | {
        "dtype": str(resolve_dtype(args.dtype, host)).removeprefix("torch."), "records_sha256": records,
        "interventions_sha256": interventions_sha256(args.reft_dir)}
    main_rank_result(lambda: prepare_partial(partial, decoding, args.resume), cpu)
    # each process appends to OUTPUT.partial/ on its node: rank 0's on a shared filesystem, else its node's own
    run_checked(lambda: node_partial(partial, decoding), participate=True, device=cpu)
    model, tokenizer, device_map = load_models(args, settings, host, gpus)
    reft_model = load_reft_model(args.reft_dir, model)
    if device_map is not None:
        device_map.place(reft_model)
    position = parse_position(settings["position"])
    num_layers = num_intervened_layers(reft_model, position, settings["share_weights"])
    if any(isinstance(item["instruction"], list) for item in items) and settings["prompt_template"] != "chat":
        raise UsageError(f"--instructions_file holds conversations, but {args.reft_dir!r} was trained with "
                         f"--prompt_template {settings['prompt_template']}; they need a run trained with chat")
    prompts, cut = prompt_ids(tokenizer, [item["instruction"] for item in items], [item["input"] for item in items],
                              settings["prompt_template"], args.model_max_length)
    if cut and is_main:
        print(f"Cut {len(cut)} prompt(s) to --model_max_length {args.model_max_length} tokens, as training cuts "
              f"an example: record(s) {', '.join(map(str, cut[:10]))}{' ...' if len(cut) > 10 else ''}")
    plan = batch_plan([len(ids) for ids in prompts], args.per_device_batch_size)

    # -- what is left: the batches no process has finished (every process reads the partial files it sees) ----
    seen = [None] * world_size
    dist.all_gather_object(seen, read_partial(partial, decoding))
    done = {index: record for records in seen for index, record in records.items()}
    finished = {number for number, batch in enumerate(plan) if all(index in done for index in batch)}
    done = {index: done[index] for number in finished for index in plan[number]}  # a batch cut by a kill: again
    left = [number for number in range(len(plan)) if number not in finished]
    share = left[rank * len(left) // world_size : (rank + 1) * len(left) // world_size]

    # -- this process's share, longest prompts first -------------------------------------------------------
    generation = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                      top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                      no_repeat_ngram_size=args.no_repeat_ngram_size, eos_token_id=tokenizer.eos_token_id)
    generation = {name: value for name, value in generation.items() if value is not None}
    progress = tqdm(total=sum(len(plan[number]) for number in share), desc=f"answering ({world_size} processes)",
                    unit="answer", dynamic_ncols=True, disable=not is_main)
    answered = {}
    with open(partial / f"rank-{rank}.jsonl", "a", encoding="utf-8") as log:
        for number in share:
            torch.manual_seed(args.seed + number)  # sampling draws the same for a batch on 1 or N processes
            output = generate_batch(reft_model, [prompts[index] for index in plan[number]], tokenizer.pad_token_id,
                                    position, settings["share_weights"], num_layers, intervene=not args.base,
                                    **generation)
            batch = {index: {"output": text, "tokens": tokens, "cut": was_cut} for index, (text, tokens, was_cut)
                     in zip(plan[number], decode_answers(tokenizer, output.sequences))}
            log.write("".join(json.dumps({"index": index, **record}) + "\n" for index, record in batch.items()))
            log.flush()
            os.fsync(log.fileno())  # a kill loses at most the batch being written
            answered.update(batch)
            progress.update(len(batch))
    progress.close()

    # -- process 0 gathers every answer and writes the file in input order ----------------------------------
    gathered = [None] * world_size
    dist.all_gather_object(gathered, answered)
    generator = args.generator_name or Path(args.reft_dir).resolve().name + ("-base" if args.base else "")
    metadata = {**decoding, "reft_dir": str(Path(args.reft_dir).resolve()), "world_size": world_size,
                "base_dtype": str(model.dtype).removeprefix("torch."), "prompts_cut": cut, "generator": generator}
    run_checked(lambda: write_answers(args.output_file, items, [done, *gathered], generator, metadata, partial),
                participate=is_main, device=cpu)
    if not is_main:  # rank 0 removed its partial directory; one on a node of its own goes too
        shutil.rmtree(partial, ignore_errors=True)


def batch_plan(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Cut every record's index into batches of `batch_size`, longest prompts first (the least padding; the largest
    batch first, so a batch that does not fit fails at once). The plan does not depend on the number of
    processes: each takes a contiguous run of its batches, so every batch, and every answer, is the same on 1
    and N processes."""
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def prepare_partial(partial: Path, decoding: dict, resume: bool) -> None:
    """Prepare OUTPUT.partial/: the answers of finished batches, one JSONL file a process, and the settings they were
    made with, which a resumed run must share."""
    settings_file = partial / "settings.json"
    if partial.exists() and not resume:
        raise UsageError(f"{partial} holds the answers of an unfinished run: add --resume to finish it, or remove "
                         "the directory")
    if resume and settings_file.exists():
        saved = json.loads(settings_file.read_text())
        differ = [name for name in decoding if saved.get(name) != decoding[name]]
        if differ:
            raise UsageError(f"--resume: {partial} was made with other settings ({', '.join(differ)}); run with "
                             "the same flags, or remove it")
    partial.mkdir(parents=True, exist_ok=True)
    settings_file.write_text(json.dumps(decoding, indent=1))


def node_partial(partial: Path, decoding: dict) -> None:
    """Make OUTPUT.partial/ on this process's node where rank 0's `prepare_partial` did not (nodes that share no
    filesystem), with the settings its answers are made with."""
    partial.mkdir(parents=True, exist_ok=True)
    settings_file = partial / "settings.json"
    if not settings_file.exists():
        staging = partial / f"settings.json.{os.getpid()}"  # whole or not at all, for the node's other processes
        staging.write_text(json.dumps(decoding, indent=1))
        staging.replace(settings_file)


def read_partial(partial: Path, decoding: dict) -> dict[int, dict]:
    """Read the answers in the partial files this process sees, by record index; a line cut by a kill is skipped. A
    node's leftover answers made with other settings are not read (rank 0 refuses its own: `prepare_partial`)."""
    if json.loads((partial / "settings.json").read_text()) != json.loads(json.dumps(decoding)):
        return {}
    answers = {}
    for path in sorted(partial.glob("rank-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            answers[record.pop("index")] = record
    return answers


def write_answers(output_file: str, items: list[dict], parts: list[dict], generator: str, metadata: dict,
                  partial: Path) -> None:
    """Write, on process 0, the answers in input order, each index exactly once, as AlpacaEval reads model outputs (a
    JSON list of instruction, output, generator, dataset; input and reference where the record has them), written
    atomically; the metadata and summary beside it (.summary.json); then the partial directory goes."""
    answers = {}
    for part in parts:
        for index, record in part.items():
            if index in answers:
                raise RuntimeError(f"record {index} was answered twice")
            answers[index] = record
    missing = sorted(set(range(len(items))) - set(answers))
    if missing or len(answers) != len(items):
        raise RuntimeError(f"{len(missing)} record(s) were not answered, the first {missing[:5]}")
    rows = []
    for index, item in enumerate(items):
        instruction = item["instruction"]
        text = instruction[-1]["content"] if isinstance(instruction, list) else instruction
        rows.append({"instruction": text, **({"input": item["input"]} if item["input"] else {}),
                     "output": answers[index]["output"],
                     **({"reference": item["reference"]} if item["reference"] is not None else {}),
                     "generator": generator, "dataset": item["dataset"]})
    stats = summary([(record["output"], record["tokens"], record["cut"]) for record in answers.values()])
    output = Path(output_file)
    output.parent.mkdir(parents=True, exist_ok=True)
    for path, content in ((output, rows), (summary_path(output), {**metadata, "summary": stats})):
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(temporary, path)
    for path in partial.iterdir():
        path.unlink()
    partial.rmdir()
    print(f"{stats['answers']} answers in {output}: {stats['mean_characters']:.0f} characters and "
          f"{stats['mean_tokens']:.1f} tokens on average, {stats['empty']} empty, {stats['cut_at_max_new_tokens']} "
          f"cut at --max_new_tokens {metadata['max_new_tokens']} (settings and summary: {summary_path(output)}).")
    repeated = len(rows) - len({row["instruction"] for row in rows})
    if repeated:
        print(f"{repeated} instruction(s) appear more than once: alpaca_eval joins answers to the reference on the "
              "instruction alone and pairs those wrongly; make each instruction unique (fold the input into it)")
    print("Score them against a reference file with the same instructions (AlpacaEval 1.0, the LoReFT paper's "
          "setting; needs OPENAI_API_KEY; docs/training.md#evaluating-answers-to-score):\n"
          f"  IS_ALPACA_EVAL_2=False alpaca_eval --model_outputs {output} --reference_outputs REFERENCE.json")


def summary_path(output: Path) -> Path:
    return output.with_name(output.stem + ".summary.json")


if __name__ == "__main__":
    main(ARGS)
