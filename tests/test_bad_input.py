"""User mistakes: one line naming the problem and the fix, a non-zero exit, and an earlier output intact.

train.py's cases run in this process (`run_in_process`): what is checked is the message, the exit status the
script asks for and the files, not a process boundary; the usage errors of test_train run in fresh ones."""

import json
import sys

import pytest
from conftest import run_in_process, torchrun, training_flags, with_faked_gpus, workers_output, write_records

SENTINEL = "an earlier result\n"


@pytest.fixture
def output_dir(tmp_path):
    directory = tmp_path / "out"
    directory.mkdir()
    (directory / "notes.txt").write_text(SENTINEL)
    return directory


def write(path, text: str | bytes):
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def bad_data(tmp_path):
    import datasets

    good = json.loads(write_records(tmp_path / "good.json", 3).read_text())
    (tmp_path / "data").mkdir()
    splits = {"train": good, "test": good[:1]}
    datasets.DatasetDict({name: datasets.Dataset.from_list(records) for name, records in splits.items()}).save_to_disk(
        tmp_path / "saved")
    datasets.Dataset.from_list(good).save_to_disk(tmp_path / "saved_dataset")
    return {
        "missing": tmp_path / "missing.json",
        "directory": tmp_path / "data",
        "not data": write(tmp_path / "notes.txt", "instruction: Hi"),
        "saved": tmp_path / "saved",
        "saved dataset": tmp_path / "saved_dataset",
        "not utf-8": write(tmp_path / "latin1.json", "[{\"instruction\": \"caf\xe9\"}]".encode("latin-1")),
        "malformed json": write(tmp_path / "broken.json", json.dumps(good)[:-5]),
        "malformed jsonl": write(tmp_path / "broken.jsonl", json.dumps(good[0]) + "\n{\"instruction\": \n"),
        "missing output": write(tmp_path / "no-output.json", json.dumps(good + [{"instruction": "Hi", "input": ""}])),
        "empty": write(tmp_path / "empty.json", "[]"),
        "zero-byte json": write(tmp_path / "0-byte.json", ""),
        "zero-byte jsonl": write(tmp_path / "0-byte.jsonl", ""),
        "question and instruction": write(tmp_path / "both.json", json.dumps([{**record, "question": "Hi"}
                                                                             for record in good])),
        "sharegpt role": write(tmp_path / "bot.jsonl", json.dumps({"conversations": [
            {"from": "human", "value": "Hi"}, {"from": "bot", "value": "Hello"}]})),
    }


CASES = [
    # (name, flags, what stderr must say)
    ("missing data file", ["--data_path", "{missing}"], "does not exist; pass a .json, .jsonl, .parquet, .csv or "
     ".arrow file (or a glob of them), a save_to_disk directory, or a hub dataset name"),
    ("not a data file", ["--data_path", "{not data}"], "is not a data file datasets reads; pass a .json"),
    ("glob of nothing", ["--data_path", "{missing}*.parquet"], "matches no file"),
    ("directory without data", ["--data_path", "{directory}"], "doesn't contain any data files"),
    ("split not saved", ["--data_path", "{saved}", "--data_split", "validation"],
     "has no split 'validation': its splits are 'train', 'test'; pick one with --data_split"),
    ("split of a Dataset", ["--data_path", "{saved dataset}", "--data_split", "validation"],
     "--data_path '{saved dataset}' is one save_to_disk Dataset, not a DatasetDict: it has no split 'validation'; "
     "drop --data_split"),
    ("config of a file", ["--data_config", "en"], "names a configuration of a hub dataset"),
    ("eval split without eval data", ["--eval_data_split", "test"], "picks a split of --eval_data_path"),
    ("unreadable data", ["--data_path", "{not utf-8}"], "cannot read --data_path"),
    ("malformed json", ["--data_path", "{malformed json}"], "cannot read --data_path"),
    ("malformed jsonl", ["--data_path", "{malformed jsonl}"], "cannot read --data_path"),
    ("record without output", ["--data_path", "{missing output}"], "record 3 of"),
    ("empty dataset", ["--data_path", "{empty}"], "holds no records"),
    ("0-byte json", ["--data_path", "{zero-byte json}"], "--data_path '{zero-byte json}' holds no records"),
    ("0-byte jsonl", ["--data_path", "{zero-byte jsonl}"], "--data_path '{zero-byte jsonl}' holds no records"),
    ("field mapped onto one the records hold", ["--data_path", "{question and instruction}", "--field_map",
                                                "question=instruction"],
     "--field_map question=instruction: the records of --data_path '{question and instruction}' hold 'instruction' "
     "and 'question', 2 fields that would be 'instruction'; keep one (drop a mapping from --field_map, or a field "
     "from the records)"),
    ("unknown sharegpt role", ["--data_path", "{sharegpt role}"], "a ShareGPT turn from 'bot'; the roles accepted"),
    ("everything truncated", ["--model_max_length", "8"], "no output token is left; raise --model_max_length"),
    ("layers not integers", ["--layers", "1;two"], "--layers '1;two' is malformed"),
    ("layer out of range", ["--layers", "1;9"], "layer 9 is out of range, the model has 4 layers"),
    ("position f1+", ["--position", "f1+"], "--position 'f1+' is malformed"),
    ("position x3", ["--position", "x3"], "--position 'x3' is malformed"),
    ("position l-1", ["--position", "l-1"], "--position 'l-1' is malformed"),
    ("position f0", ["--position", "f0"], "--position 'f0' is malformed"),
    ("rank zero", ["--rank", "0"], "--rank must be a positive integer"),
    ("rank too large", ["--rank", "64"], "--rank 64 must be smaller than the model's hidden size 64"),
    ("batch size zero", ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size must be a positive"),
    ("accumulation zero", ["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be a positive"),
    ("output_dir is a file", ["--output_dir", "{output_dir}/notes.txt"], "is a file; pass a directory path"),
    ("output_dir not writable", ["--output_dir", "/proc/reft-alpaca-out"], "is not writable"),
    ("model path missing", ["--model_name_or_path", "./no/such/model"], "does not exist; pass a model directory"),
    ("chat prompt without a chat template", ["--prompt_template", "chat"],
     "--prompt_template chat: the tokenizer of '{model}' has no chat template; use --prompt_template alpaca or a "
     "chat model"),
    ("component inside a recomputed layer", ["--component", "mlp_output", "--gradient_checkpointing"],
     "--gradient_checkpointing recomputes whole decoder layers, inside which --component mlp_output is hooked"),
    ("pack budget without packing", ["--packing_max_tokens", "1024"], "--packing_max_tokens sets the size of a pack; "
     "add --packing"),
    ("pack budget below an example", ["--packing", "--packing_max_tokens", "256"], "--packing_max_tokens 256 is below "
     "--model_max_length 512"),
    ("varlen attention without packs", ["--attn_implementation", "sdpa_varlen"], "--attn_implementation sdpa_varlen "
     "only changes how packs attend; add --packing"),
    ("varlen attention on a CPU", ["--attn_implementation", "sdpa_varlen", "--packing"], "runs torch's varlen "
     "flash kernel, on CUDA GPUs of compute capability 8.0 or more only; use sdpa"),
    ("flash attention without flash-attn", ["--attn_implementation", "flash_attention_2"], "--attn_implementation "
     "flash_attention_2 needs the flash-attn package (on a GPU it supports), which is not installed here"),
    ("unknown flag", ["--learning_rat", "1e-3"], "unrecognized arguments: --learning_rat"),
    ("eval without eval data", ["--eval_strategy", "steps"], "--eval_strategy steps needs evaluation data"),
    ("eval split ratio out of range", ["--eval_split_ratio", "1.5"], "--eval_split_ratio must be in (0, 1)"),
    ("eval split leaves nothing", ["--eval_split_ratio", "0.9"], "leaves one side empty"),
    ("two eval sources", ["--eval_split_ratio", "0.2", "--eval_data_path", "{missing}"], "are exclusive"),
    ("missing eval file", ["--eval_data_path", "{missing}"], "--eval_data_path '"),
    ("malformed eval file", ["--eval_data_path", "{malformed json}"], "--eval_data_path '"),
    ("missing resume checkpoint", ["--resume_from_checkpoint", "{output_dir}/checkpoint-7"],
     "is missing (no such directory); pass an intact checkpoint-<step> directory"),
    # device maps (tests/test_device_map.py: good ones), against the model and the devices; {{ }} is a brace
    ("device map naming no module", ["--device_map", '{{"model.embed": "cpu", "": "cpu"}}'],
     "--device_map names 'model.embed', which is not a module of LlamaForCausalLM; use its modules' names"),
    ("device map on a GPU that is not there", ["--device_map", '{{"": 0}}'],
     "--device_map: GPU 0 is not there: this process has no GPU (and 'cpu', 'disk'); name a device it has"),
    ("max memory of a GPU that is not there", ["--device_map", "auto", "--max_memory", '{{"1": "1GiB"}}'],
     "--max_memory: GPU 1 is not there"),
    ("device map on an unknown device", ["--device_map", '{{"": "mps"}}'],
     "--device_map: device 'mps' is not a GPU index, 'cuda:N', 'cpu' or 'disk'"),
    ("device map leaving a module unplaced", ["--device_map", '{{"model": "cpu"}}'],
     "--device_map leaves 'lm_head.weight' unplaced; give it (or a module holding it) a device"),
    ("device map neither a name nor JSON", ["--device_map", "{{model: cpu}}"],
     "--device_map '{{model: cpu}}' is neither one of auto, balanced, balanced_low_0, sequential nor a JSON object"),
    ("disk without an offload folder", ["--device_map", '{{"": "disk"}}'], "add --offload_folder DIR"),
    ("max memory without a device map", ["--max_memory", '{{"cpu": "1GiB"}}'],
     "--max_memory applies to a --device_map; add --device_map auto"),
    ("max memory not a size", ["--device_map", "auto", "--max_memory", '{{"cpu": "lots"}}'],
     "--max_memory: 'lots' for 'cpu' is not a size"),
    # numbers, against what they mean
    ("negative learning rate", ["--learning_rate", "-1"], "--learning_rate must be positive, got -1.0"),
    ("infinite learning rate", ["--learning_rate", "inf"], "--learning_rate must be positive, got inf"),
    ("warmup ratio above 1", ["--warmup_ratio", "2"], "--warmup_ratio must be in [0, 1], got 2.0"),
    ("negative weight decay", ["--weight_decay", "-1"], "--weight_decay must be 0 or more, got -1.0"),
    ("beta of 1", ["--adam_beta2", "1"], "--adam_beta2 must be in [0, 1), got 1.0"),
    ("no epochs", ["--num_train_epochs", "0"], "--num_train_epochs must be positive (--max_steps, when given, "
     "overrides it), got 0.0"),
    ("negative max steps", ["--max_steps", "-5"], "--max_steps must be a positive integer, or -1 to train "
     "--num_train_epochs, got -5"),
    ("logging every 0 steps", ["--logging_steps", "0"], "--logging_steps must be a whole number of steps, or below 1 "
     "a fraction of the run, got 0.0"),
    ("logging every 2.5 steps", ["--logging_steps", "2.5"], "--logging_steps must be a whole number of steps"),
    ("negative checkpoint limit", ["--save_total_limit", "-1"], "--save_total_limit must be at least 1 (leave it out "
     "to keep every checkpoint), got -1"),
    ("negative seed", ["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
]


@pytest.mark.fast
@pytest.mark.parametrize("name,flags,message", CASES, ids=[case[0] for case in CASES])
def test_bad_input(name, flags, message, tiny_model, tmp_path, output_dir):
    paths = {**{key: str(value) for key, value in bad_data(tmp_path).items()}, "output_dir": str(output_dir),
             "model": str(tiny_model)}
    flags, message = [flag.format(**paths) for flag in flags], message.format(**paths)
    one_step = [item for key, value in {"--num_sample_answers": "0", "--max_steps": "1"}.items() if key not in flags
                for item in (key, value)]
    args = training_flags(tiny_model, write_records(tmp_path / "ok.json", 5), output_dir, *one_step, *flags)
    status, _, stderr = run_in_process("train.py", args)
    assert status == 2, stderr[-2000:]
    # One error line, the last thing printed (progress bars of the work done before it may precede it).
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0], stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == errors[0] and "Traceback" not in stderr
    assert (output_dir / "notes.txt").read_text() == SENTINEL
    assert sorted(p.name for p in output_dir.iterdir()) == ["notes.txt"]


@pytest.mark.fast
def test_a_finished_run_is_not_overwritten(tiny_model, tmp_path, output_dir):
    data = write_records(tmp_path / "ok.json", 5)
    args = training_flags(tiny_model, data, output_dir, "--num_sample_answers", "0", "--max_steps", "1")
    assert run_in_process("train.py", args)[0] == 0
    finished = {p.name: p.read_bytes() for p in output_dir.iterdir()}
    status, _, stderr = run_in_process("train.py", [*args, "--learning_rate", "1"])
    assert status == 2
    assert "already holds a run; resume it with --resume_from_checkpoint auto, or pass --overwrite_output_dir" \
        in stderr
    assert {p.name: p.read_bytes() for p in output_dir.iterdir()} == finished
    assert run_in_process("train.py", [*args, "--overwrite_output_dir"])[0] == 0


def test_more_processes_than_examples(tiny_model, tmp_path, output_dir):
    result = torchrun(2, ["train_multigpu.py", *training_flags(tiny_model, write_records(tmp_path / "one.json", 1),
                                                               output_dir, "--num_sample_answers", "0")])
    assert result.returncode != 0
    message = "1 training examples for 2 processes: every process needs at least one"
    assert workers_output(result.stderr).count(message) == 1
    assert (output_dir / "notes.txt").read_text() == SENTINEL


def test_more_processes_than_gpus(tiny_model, tmp_path, output_dir):
    """2 processes on a node with 1 GPU (faked: CUDA reported with one device): one line says what to do."""
    result = torchrun(2, [*with_faked_gpus(1), "train_multigpu.py", "--model_name_or_path",
                          str(tiny_model), "--output_dir", str(output_dir)], extra=["--no-python"])
    assert result.returncode != 0
    message = "train_multigpu.py: error: 2 processes on this node but 1 GPU(s) visible; launch with --nproc_per_node 1"
    assert workers_output(result.stderr).count(message) == 1, result.stderr[-3000:]
    assert (output_dir / "notes.txt").read_text() == SENTINEL


def test_a_mistake_every_rank_finds_is_reported_by_rank_0_even_when_it_is_last(output_dir):
    """Each rank refuses --learning_rate -1 at parse time, rank 0 last (it starts 5 s late). The others wait for
    torchrun to stop them: one leaving first would get rank 0 stopped before it has printed."""
    rank_0_late = ("import os, runpy, sys, time; time.sleep(5 if os.environ['RANK'] == '0' else 0); "
                   "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    result = torchrun(2, [sys.executable, "-c", rank_0_late, "train_multigpu.py", "--learning_rate", "-1",
                          "--output_dir", str(output_dir)], extra=["--no-python"])
    assert result.returncode != 0
    message = "train_multigpu.py: error: --learning_rate must be positive, got -1.0"
    assert workers_output(result.stderr).count(message) == 1, result.stderr[-3000:]
    assert (output_dir / "notes.txt").read_text() == SENTINEL


def test_bad_input_on_every_rank_is_reported_once(tiny_model, tmp_path, output_dir):
    result = torchrun(2, ["train_multigpu.py", "--model_name_or_path", str(tiny_model), "--data_path",
                          str(tmp_path / "missing.json"), "--output_dir", str(output_dir)])
    assert result.returncode != 0
    assert workers_output(result.stderr).count("does not exist; pass a .json") == 1


def test_non_ascii_and_very_long_records_just_work(tiny_model, tmp_path):
    records = [
        {"instruction": "把这句话翻译成英文。", "input": "我喜欢学习。", "output": "I like studying."},
        {"instruction": "Describe the sea 🌊 in one line.", "input": "", "output": "Blue, deep and restless 🌊☀️."},
        {"instruction": "Summarize: " + "lorem ipsum dolor " * 2000, "input": "", "output": "Filler text."},
        {"instruction": "Repeat the word 'ok'.", "input": "", "output": "ok " * 5000},
    ]
    data = write(tmp_path / "unicode.jsonl", "\n".join(json.dumps(r, ensure_ascii=False) for r in records))
    status, stdout, stderr = run_in_process("train.py", training_flags(
        tiny_model, data, tmp_path / "out", "--num_sample_answers", "1", "--max_new_tokens", "4", "--max_steps", "2",
        "--per_device_train_batch_size", "2"))
    assert status == 0, stderr[-3000:]
    assert "Dropped 1 example(s) whose prompt alone reaches --model_max_length" in stdout


def test_a_torch_older_than_the_tested_range_is_refused_before_any_weight_loads(tiny_model, tmp_path, output_dir,
                                                                                monkeypatch):
    """GPU images ship their own torch: one older than the tested range is one line naming the range, from either
    script, before anything loads (the version faked where the check reads it); 2.11 is in the range."""
    import alpaca.versions

    runs = {"train.py": training_flags(tiny_model, write_records(tmp_path / "ok.json", 5), output_dir, "--max_steps",
                                       "1", "--num_sample_answers", "0"),
            "examples/generate.py": ["--reft_dir", str(output_dir), "--instruction", "Hi", "--max_new_tokens", "2"]}
    for script, flags in runs.items():
        monkeypatch.setattr(alpaca.versions, "version", lambda package: "2.10.1+cu128")
        status, stdout, stderr = run_in_process(script, flags)
        assert status == 2 and not stdout and stderr.strip().splitlines() == [
            f"{script.rsplit('/')[-1]}: error: torch 2.10.1+cu128 is older than 2.11, the oldest these scripts are "
            "tested with (2.11 to 2.13); pip install 'torch>=2.11'"], stderr[-2000:]
        assert (output_dir / "notes.txt").read_text() == SENTINEL
        monkeypatch.setattr(alpaca.versions, "version", lambda package: "2.11.0+cu130")
        assert run_in_process(script, flags)[0] == 0


def test_fsdp_on_a_4bit_base_is_refused_on_torch_2_11(tiny_model, tmp_path, output_dir, monkeypatch):
    """torch 2.11's FSDP2 makes a 4-bit base's packed bytes parameters that require a gradient (a RuntimeError) and,
    on a GPU, casts them to bf16 (a silently wrong forward, seen on an H200): --fsdp --load_in_4bit is one line there,
    before anything loads (the version faked where the check reads it); tests/test_quantized.py trains it on 2.13."""
    import alpaca.versions

    monkeypatch.setattr(alpaca.versions, "version", lambda package: "2.11.0+cu130")
    flags = training_flags(tiny_model, write_records(tmp_path / "ok.json", 5), output_dir, "--max_steps", "1",
                           "--num_sample_answers", "0", "--fsdp", "--load_in_4bit")
    status, stdout, stderr = run_in_process("train_multigpu.py", flags)
    assert status == 2 and stderr.strip().splitlines() == [
        "train_multigpu.py: error: --fsdp --load_in_4bit needs torch 2.12 or newer (torch 2.11.0+cu130's FSDP2 handles "
        "the packed 4-bit bytes as floating-point weights); pip install 'torch>=2.12', or drop --fsdp: DDP holds the "
        "whole 4-bit base on each GPU"], stderr[-2000:]
    assert sorted(p.name for p in output_dir.iterdir()) == ["notes.txt"]
