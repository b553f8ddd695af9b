"""Caches are checked when read: a damaged tokenized dataset or converted default model is built again, with a
one-line notice, never a traceback; concurrent first runs on one cache share it."""

import json
import multiprocessing

import datasets
from conftest import build_tiny_model, copy_as_killed, disk_map, run_in_process, training_flags, write_records

import alpaca.data
import alpaca.launcher_env
import alpaca.model
from alpaca.args import build_parser
from alpaca.data import load_records, prepare_dataset, tokenize, tokenize_splits, tokenizing_processes
from alpaca.manifest import MANIFEST, directory_problem, write_manifest
from alpaca.model import embedded_model_dir

# What transformers' GGUF loader puts in the default model's config, and conversions before version 2 kept.
GGUF_KEY = {"dequantize": False, "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "quant_method": "gguf"}


def run_flags(data, output_dir, cache_dir, *extra) -> list[str]:
    """A one-step run on `data` with its caches in `cache_dir`, of the default model unless `extra` names one."""
    return training_flags(None, data, output_dir, "--cache_dir", cache_dir, "--max_steps", "1", "--num_sample_answers",
                          "0", "--overwrite_output_dir", *extra)


def test_a_tokenized_cache_cut_short_is_rebuilt(tiny_model, tmp_path):
    """A run, then one of its cache's files cut short (as a full disk or an interrupted copy leaves it): the next
    run says so in one line, tokenizes again and trains."""
    args = run_flags(write_records(tmp_path / "data.json", 5), tmp_path / "out", tmp_path / "cache",
                     "--model_name_or_path", tiny_model)
    status, _, stderr = run_in_process("train.py", args)
    assert status == 0, stderr[-3000:]
    [cache] = (tmp_path / "cache" / "tokenized").iterdir()
    [arrow] = cache.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    status, _, stderr = run_in_process("train.py", args)
    assert status == 0, stderr[-3000:]
    assert (f"warning: the tokenized data in {cache} is incomplete ({arrow.name} is missing or cut short); building "
            "it again") in stderr.splitlines()
    assert "Traceback" not in stderr and directory_problem(cache) is None


def test_a_tokenized_cache_with_a_flipped_byte_is_rebuilt(tokenizer, tiny_data, tmp_path, capsys):
    """Damage that keeps the size (a token id changed): the SHA-256 tells it; the rebuilt cache is the data."""
    records = load_records(str(tiny_data))
    prepare_dataset(records, tokenizer, 512, str(tmp_path))
    [cache] = (tmp_path / "tokenized").iterdir()
    [arrow] = cache.glob("*.arrow")
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 0x01
    arrow.write_bytes(bytes(data))
    capsys.readouterr()
    dataset = prepare_dataset(records, tokenizer, 512, str(tmp_path))
    assert (f"warning: the tokenized data in {cache} is damaged ({arrow.name} does not match its SHA-256 in "
            f"{MANIFEST}); building it again") in capsys.readouterr().err.splitlines()
    assert dataset["input_ids"] == tokenize(records, tokenizer, 512)["input_ids"]


def first_run(tokenizer, data_path: str, cache_dir: str, both_tokenizing, results) -> None:
    """One of two processes starting on an empty cache: each tokenizes (both at once: neither goes on before
    the other has begun), then puts its copy in place or finds the other's."""
    tokenize = alpaca.data.tokenize

    def tokenize_with_the_other(*args, **kwargs):
        both_tokenizing.wait(timeout=60)
        return tokenize(*args, **kwargs)

    alpaca.data.tokenize = tokenize_with_the_other
    results.put(prepare_dataset(load_records(data_path), tokenizer, 512, cache_dir)["input_ids"])


def test_concurrent_first_runs_share_one_cache(tokenizer, tiny_data, tmp_path):
    context = multiprocessing.get_context("fork")  # the test's imports and tokenizer, without a fresh interpreter
    both_tokenizing, results = context.Barrier(2), context.Queue()
    processes = [context.Process(target=first_run, args=(tokenizer, str(tiny_data), str(tmp_path), both_tokenizing,
                                                         results)) for _ in range(2)]
    for process in processes:
        process.start()
    outputs = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert [process.exitcode for process in processes] == [0, 0]
    expected = tokenize(load_records(str(tiny_data)), tokenizer, 512)["input_ids"]
    assert outputs == [expected, expected]
    [cache] = (tmp_path / "tokenized").iterdir()  # one cache, no staging copy left
    assert directory_problem(cache) is None


def test_a_damaged_converted_default_model_is_converted_again(tiny_data, tmp_path, monkeypatch):
    """The default model's converted directory with its weights cut short: the next run with the default model
    says so in one line, converts again and trains. The conversion (40 s of dequantizing the GGUF) is replaced
    by writing a tiny model; what is tested is the check and the rebuild around it."""
    conversions = []

    def convert(directory):
        conversions.append(directory)
        build_tiny_model(directory)

    monkeypatch.setattr(alpaca.model, "convert_embedded_model", convert)
    converted = embedded_model_dir(str(tmp_path / "cache"))
    assert directory_problem(converted) is None and len(conversions) == 1
    weights = converted / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    args = run_flags(tiny_data, tmp_path / "out", tmp_path / "cache")
    status, stdout, stderr = run_in_process("train.py", args)
    assert status == 0, stderr[-3000:]
    assert (f"warning: the converted default model in {converted} is incomplete (model.safetensors is missing or "
            "cut short); building it again") in stderr.splitlines()
    assert len(conversions) == 2 and directory_problem(converted) is None and "Traceback" not in stderr
    assert not [path for path in converted.parent.iterdir() if path.name.startswith(".")]  # no staging left


def test_a_default_model_converted_in_an_earlier_format_is_converted_again_and_its_checkpoints_refused(
        tiny_data, tmp_path, monkeypatch):
    """An earlier conversion kept GGUF's quantization_config in config.json (with which transformers refuses a device
    map with 'disk' for the default model), in a directory of another name. A run on such a directory leaves
    checkpoint-2. The next run with the default model does not read that directory: it converts the model into its
    own (without the key, the weights the same) and refuses the checkpoint in one line naming the base model's
    config; a new run trains with layers on disk. The conversion is the real one (alpaca.model.convert_embedded_model)
    but for its two GGUF reads, which load a tiny model as transformers' GGUF loader returns it (the key in its
    config)."""
    import transformers

    gguf_like = build_tiny_model(tmp_path / "gguf")
    config = json.loads((gguf_like / "config.json").read_text())
    (gguf_like / "config.json").write_text(json.dumps({**config, "quantization_config": GGUF_KEY}))
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        def from_pretrained(path, *args, original=auto.from_pretrained, **kwargs):
            return original(gguf_like if kwargs.pop("gguf_file", None) else path, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", from_pretrained)
    earlier = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    earlier.mkdir(parents=True)
    alpaca.model.convert_embedded_model(earlier)  # then as the earlier format left it: the key kept
    (earlier / "config.json").write_text(json.dumps({**json.loads((earlier / "config.json").read_text()),
                                                     "quantization_config": GGUF_KEY}))
    write_manifest(earlier)
    weights = (earlier / "model.safetensors").read_bytes()

    args = training_flags(None, tiny_data, None, "--cache_dir", tmp_path / "cache", "--max_steps", "4",
                          "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1",
                          "--per_device_train_batch_size", "2", "--num_sample_answers", "0")
    with monkeypatch.context() as earlier_run:  # a run on the earlier conversion
        earlier_run.setattr(alpaca.model, "embedded_model_dir", lambda cache_dir=None: earlier)
        status, _, stderr = run_in_process("train.py", [*args, "--output_dir", tmp_path / "old"])
    assert status == 0, stderr[-3000:]
    resumed = copy_as_killed(tmp_path / "old", tmp_path / "resumed", last_checkpoint=2)
    disk = ["--device_map", disk_map(), "--offload_folder", tmp_path / "offload"]
    status, _, stderr = run_in_process("train.py", [*args, "--output_dir", resumed, *disk,
                                                    "--resume_from_checkpoint", "auto"])
    assert status == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "train.py: error: this run differs from the checkpoint in the base model's config (--model_name_or_path "
        "'embedded:SmolLM2-135M-Instruct'). Resume with the data, model and flags the checkpoint was trained with "
        "(its training_args.json), or train anew in another --output_dir")
    converted = embedded_model_dir(str(tmp_path / "cache"))
    assert converted != earlier and directory_problem(converted) is None
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    assert (converted / "model.safetensors").read_bytes() == weights
    status, stdout, stderr = run_in_process("train.py", [*args, "--output_dir", tmp_path / "new", *disk])
    assert status == 0, stderr[-3000:]
    assert "disk: 2 modules" in stdout and "building it again" not in stderr



def test_two_tokenizing_processes_give_one_s_tokens_and_cache(tokenizer, chat_tokenizer, tiny_data, tmp_path,
                                                              monkeypatch):
    """--preprocessing_num_workers 2 tokenizes Alpaca records and conversations (several turns, labelled spans) into
    the very columns one process makes, in order, under the same cache key: a run with 2 reads the cache a run
    with 1 wrote. The flag reaches the tokenizer; by default the process takes the cores it may run on, whatever
    the processes on its node (one of them tokenizes while the others wait), one process a 10,000 records at most,
    and one process where it has 2 or fewer."""
    records = load_records(str(tiny_data))
    conversations = datasets.Dataset.from_dict({"messages": [
        [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}] * (1 + i % 2)
        for i, r in enumerate(records)]})
    for data, tokenizer_, template in ((records, tokenizer, "alpaca"), (conversations, chat_tokenizer, "chat")):
        one = tokenize(data, tokenizer_, 512, template).to_dict()
        assert tokenize(data, tokenizer_, 512, template, num_proc=2).to_dict() == one and len(one["input_ids"]) > 2
    cached = prepare_dataset(records, tokenizer, 512, str(tmp_path), num_proc=1)
    [cache] = (tmp_path / "tokenized").iterdir()
    written = {path.name: path.stat().st_mtime_ns for path in cache.iterdir()}
    assert prepare_dataset(records, tokenizer, 512, str(tmp_path), num_proc=2)[:] == cached[:]
    assert list((tmp_path / "tokenized").iterdir()) == [cache]  # the same key: read, not written again
    assert {path.name: path.stat().st_mtime_ns for path in cache.iterdir()} == written

    asked = []
    monkeypatch.setattr(alpaca.data, "prepare_dataset", lambda *args: asked.append(args[-1]))
    args = build_parser("train.py").parse_args(["--preprocessing_num_workers", "2"])
    tokenize_splits([records, None], tokenizer, args)
    monkeypatch.setattr(alpaca.launcher_env.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args.preprocessing_num_workers = None
    tokenize_splits([records], tokenizer, args)
    assert asked == [2, 1]
    assert [tokenizing_processes(None, count) for count in (9_999, 30_000, 1_000_000)] == [1, 3, 16]
    monkeypatch.setattr(alpaca.launcher_env.os, "sched_getaffinity", lambda pid: {0, 1})  # the tokenizer's threads
    assert tokenizing_processes(None, 1_000_000) == 1 and tokenizing_processes(3, 10) == 3
