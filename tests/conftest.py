"""Shared fixtures: a tiny random Llama with a tiny BPE tokenizer, and small Alpaca files; all built offline."""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import runpy
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alpaca.checkpoint import checkpoints
from alpaca.output import ARGS_FILE, FINISHED_FILE, read_metrics

REPO = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO / "examples" / "data" / "alpaca_sample.json"


def build_tiny_model(directory: Path, pad_token: bool = False, unk_token: bool = True,
                     tie_word_embeddings: bool = False, family: str = "Llama", **config) -> Path:
    """A 4-layer decoder (hidden 64) of a transformers `family` (its config class's name less 'Config': 'Llama',
    'Qwen3', 'Gemma3Text', ...) and a BPE tokenizer trained on the shipped sample data; with
    `tie_word_embeddings` its LM head is its embedding matrix, as in SmolLM2 and Llama-3.2. `config` overrides
    the config's fields."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    special = ["<s>", "</s>"] + (["<unk>"] if unk_token else []) + (["<pad>"] if pad_token else [])
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>" if unk_token else None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    records = json.loads(SAMPLE_DATA.read_text())
    texts = [r["instruction"] + " " + r["input"] + " " + r["output"] for r in records]
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>" if unk_token else None,
                                   pad_token="<pad>" if pad_token else None)
    torch.manual_seed(0)
    fields = dict(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                  tie_word_embeddings=tie_word_embeddings,
                  # Large random weights give peaked attention, so interventions on a few prompt positions
                  # move the output loss visibly (at 0.02 everything is near uniform).
                  initializer_range=0.3)
    AutoModelForCausalLM.from_config(getattr(transformers, f"{family}Config")(**{**fields, **config})).save_pretrained(
        directory)
    fast.save_pretrained(directory)
    return directory


# ChatML-like, as SmolLM2-Instruct's, but with the tiny tokenizer's own special tokens: BOS written by the template
# (so it must not be added again) and each turn ended by EOS and a newline (the newline is never generated).
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_chat_template(model_dir: Path, directory: Path, chat_template: str = CHAT_TEMPLATE) -> Path:
    """A copy of a tiny model whose tokenizer has `chat_template`."""
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_model, tmp_path_factory) -> Path:
    return with_chat_template(tiny_model, tmp_path_factory.mktemp("tiny-chat") / "model")


def scripts_tokenizer(model_dir):
    """The tokenizer of the model in `model_dir` as the scripts load it: right padding, a pad token."""
    from alpaca.model import load_base_model

    return load_base_model(str(model_dir), torch.float32, torch.device("cpu"))[1]


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_chat_model):
    return scripts_tokenizer(tiny_chat_model)


# A tensor put in oneDNN's layout in a fresh interpreter, with oneDNN telling which
# instruction set it dispatches to.
ONEDNN_ISA_PROBE = ("import torch; torch.ones(1, 8, 8, 8).to_mkldnn(); "
                    "print(torch.backends.cpu.get_cpu_capability())")


def pytest_sessionstart(session) -> None:
    """One line saying where the suite runs: the last bits of every float32 and bf16 kernel depend on the CPU's
    instruction sets, so a failure report needs it."""
    probe = subprocess.run([sys.executable, "-c", ONEDNN_ISA_PROBE], env={**os.environ, "ONEDNN_VERBOSE": "1"},
                           capture_output=True, text=True)
    isa = re.search(r"info,cpu,isa:(.*)", probe.stdout)
    cpu = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M) \
        if Path("/proc/cpuinfo").exists() else None
    line = (f"CPU: {cpu[1] if cpu else platform.processor() or platform.machine()} | torch CPU capability: "
            f"{probe.stdout.strip().splitlines()[-1] if probe.returncode == 0 else '?'} | oneDNN ISA: "
            f"{isa[1] if isa else '?'}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Tokenized datasets, the caches of datasets' loaders (and any converted model) go to a throwaway cache, not
    the user's; so do the kernels --torch_compile builds. Inductor's cache key leaves out ATEN_CPU_CAPABILITY
    (torch 2.13): kernels it built under another kernel set (`make test-other-cpus`) would be reused, and they
    crash or compute NaN."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    # `datasets` read its cache's place when a test module imported it, before this: its loaders' caches too.
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("datasets"))
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_DATASETS_CACHE = Path(os.environ["HF_DATASETS_CACHE"])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    return scripts_tokenizer(tiny_model)


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory) -> Path:
    """Tied input and output embeddings: one parameter in two places, which FSDP must shard once."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-tied"), tie_word_embeddings=True)


def mixed_records() -> list[dict]:
    """The shipped sample with records with and without `input` alternating, so that any slice of a few
    records exercises both prompt templates."""
    records = json.loads(SAMPLE_DATA.read_text())
    with_input, without = [r for r in records if r["input"]], [r for r in records if not r["input"]]
    alternating = [record for pair in zip(without, with_input) for record in pair]
    return alternating + without[len(with_input) :]


def write_records(path: Path, count: int, start: int = 0) -> Path:
    """`count` records of the shipped sample from `start` on, with and without input alternating (odd counts
    make partial last batches)."""
    path.write_text(json.dumps(mixed_records()[start : start + count], ensure_ascii=False))
    return path


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return write_records(tmp_path_factory.mktemp("data") / "alpaca.json", 21)


@pytest.fixture(scope="session")
def tiny_eval_data(tmp_path_factory) -> Path:
    """5 held-out records: in batches of 2 that is 3 batches, so 2 ranks hold 2 and 1."""
    return write_records(tmp_path_factory.mktemp("data") / "alpaca_eval.json", 5, start=21)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_script(args: list[str], cwd: Path = REPO, env: dict | None = None, timeout: int = 300,
               launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run one of the project's scripts in a fresh interpreter (as a user would) and capture its output."""
    command = (launcher or [sys.executable]) + args
    # On CPU even where a GPU is visible: the tests compare float32 results of 1 and 2 processes (gloo).
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
                **(env or {})}
    for name in ("WANDB_MODE", "WANDB_API_KEY"):  # tests never reach wandb's servers
        full_env.pop(name, None)
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


LAYERS = "1;2"  # the tiny model's layers intervened on: of its 4, one below them and one above


def training_flags(model, data, output_dir, *extra) -> list[str]:
    """The command line of a run of `model` on `data` into `output_dir` (each left out where None) intervening
    on LAYERS, then `extra`; a flag named in `extra` replaces its default."""
    defaults = {"--model_name_or_path": model, "--data_path": data, "--output_dir": output_dir, "--layers": LAYERS}
    return [*(token for name, value in defaults.items() if value is not None and name not in extra
              for token in (name, str(value))), *extra]


# What the equivalence runs (COMMON, FLAGS) add to training_flags: the first and last 2 positions of the prompt, rank 4,
# a learning rate that moves the tiny model within a few steps after 2 warmup steps, each step logged.
EQUIVALENCE_RUN = ["--position", "f2+l2", "--rank", "4", "--learning_rate", "1e-2", "--logging_steps", "1",
                   "--num_sample_answers", "0", "--warmup_steps", "2"]
COMMON = [*EQUIVALENCE_RUN, "--num_train_epochs", "3"]


# torchrun looks at its workers only every 10 s: a rank that ends within a test's time ended on its own.
EACH_RANK_ENDS_ON_ITS_OWN = ["--monitor-interval", "10"]


# What tests/faults.py writes of each process: the process-group threads still running at its exit, and the
# exit status the script asked for.
FAULTS_REPORT = re.compile(r"process-group threads at exit: (\[.*?\]); exit status (-?\d+)")


def threads_left(stderr: str) -> list[str]:
    return [threads for threads, _ in FAULTS_REPORT.findall(stderr)]


def exit_statuses(stderr: str) -> list[int]:
    return [int(status) for _, status in FAULTS_REPORT.findall(stderr)]


def assert_every_rank_left_on_its_own(torchrun_stderr: str) -> None:
    """After a rank failed (and said why), each rank's script ended by itself with status 1, under
    EACH_RANK_ENDS_ON_ITS_OWN: tests/faults.py's report of each. (torchrun's own summary can show -15 for a rank
    that had ended and was still tearing down its interpreter when torchrun looked.)"""
    assert exit_statuses(torchrun_stderr) == [1, 1], torchrun_stderr[-3000:]


def torchrun(nproc: int, args: list[str], extra: list[str] | None = None, timeout: int = 300, env: dict | None = None):
    """torchrun on a free port: tests run in parallel (pytest-xdist), and torchrun's default port is one."""
    return run_script(["--nproc_per_node", str(nproc), "--master_port", str(free_port()), *(extra or []), *args],
                      launcher=[sys.executable, "-m", "torch.distributed.run"], timeout=timeout, env=env)


def workers_output(torchrun_stderr: str) -> str:
    """torchrun's stderr less its summary of a failed job, whose "Root Cause" repeats that worker's error line."""
    return torchrun_stderr.split("\n" + "=" * 60 + "\n", 1)[0]


def with_faked_gpus(count: int) -> list[str]:
    """A command for `torchrun --no-python` that runs the script after it as if CUDA saw `count` GPUs: how the
    scripts choose each process's GPUs, tested without one."""
    return [sys.executable, "-c", "import runpy, sys, torch; torch.cuda.is_available = lambda: True; "
            f"torch.cuda.device_count = lambda: {count}; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')"]


def run_in_process(script: str, argv: list[str]) -> tuple[int, str, str]:
    """One of the project's scripts (train.py, train_multigpu.py, examples/generate.py) run as `python script argv`
    runs it, but in this process: (exit status, stdout, stderr). For runs where no process boundary is under test
    (usage errors, refused resumes, runs that others are compared with, resumes after a crash); it saves the
    imports a fresh interpreter pays. The environment (train_multigpu.py sets a world of one), sys.argv and
    the stop-signal handlers are restored afterwards."""
    handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    environment, saved_argv = dict(os.environ), sys.argv
    stdout, stderr, status = io.StringIO(), io.StringIO(), 0
    try:
        sys.argv = [str(REPO / script), *(str(arg) for arg in argv)]
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit:
        if isinstance(exit.code, str):  # what the interpreter does with sys.exit(message)
            stderr.write(exit.code + "\n")
        status = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
    finally:
        sys.argv = saved_argv
        for number, handler in handlers.items():
            signal.signal(number, handler)
        os.environ.clear()
        os.environ.update(environment)
    return status, stdout.getvalue(), stderr.getvalue()


@contextlib.contextmanager
def one_thread():
    """As torchrun runs each worker (OMP_NUM_THREADS=1): a one-process run compared with 2 ranks then differs from
    them by the process count alone, not by its kernels' summation order over threads too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def copy_as_killed(run_dir: Path, directory: Path, last_checkpoint: int) -> Path:
    """What the finished run in `run_dir` would have left had it been killed after writing checkpoint
    `last_checkpoint` (runs are deterministic): its later checkpoints, its output and later metrics gone."""
    shutil.copytree(run_dir, directory, dirs_exist_ok=True)
    later = [path for path in checkpoints(directory) if int(path.name.split("-")[1]) > last_checkpoint]
    for path in [*later, directory / "loss.png", directory / "config.json", *directory.glob("intkey_*.bin"),
                 directory / FINISHED_FILE]:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    metrics = [line for line in (directory / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["step"] <= last_checkpoint]
    (directory / "metrics.jsonl").write_text("".join(line + "\n" for line in metrics))
    return directory


def intervention_weights(directory) -> dict[str, torch.Tensor]:
    return {f"{path.name}/{name}": tensor for path in sorted(Path(directory).glob("intkey_*.bin"))
            for name, tensor in torch.load(path, weights_only=True).items()}


def loss_and_gradients(reft_model, batch: dict, forward=None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`batch`'s summed token loss on CPU, through `forward` (what wraps `reft_model` in training) or else
    `reft_model`, and its gradients with respect to the interventions' parameters."""
    from alpaca.loss import summed_token_loss
    from alpaca.model import intervention_parameters

    loss = summed_token_loss(reft_model if forward is None else forward, batch, torch.device("cpu"))
    return loss.detach(), torch.autograd.grad(loss, [parameter for _, parameter in intervention_parameters(reft_model)])


def reloaded_eval_loss(run_dir, model_dir, records, dtype: torch.dtype = torch.float32) -> float:
    """The per-token loss on `records` of a run's saved interventions, loaded as a user loads them (pyreft's
    loader) and put in eval mode, one example at a time without padding; on the base in `dtype`."""
    import torch.nn.functional as F

    from alpaca.collate import intervention_locations
    from alpaca.data import format_prompt
    from alpaca.flag_values import parse_position
    from alpaca.model import load_base_model, num_intervened_layers
    from alpaca.output import load_reft_model
    from alpaca.workarounds import set_train_mode

    model, tokenizer = load_base_model(str(model_dir), dtype, torch.device("cpu"))
    reft_model = load_reft_model(run_dir, model)
    set_train_mode(reft_model, False)
    args = saved_arguments(run_dir)
    position = parse_position(args["position"])
    num_layers = num_intervened_layers(reft_model, position, args["share_weights"])
    loss_sum, label_tokens = 0.0, 0
    for record in records:
        prompt = tokenizer(format_prompt(record["instruction"], record["input"]))["input_ids"]
        output = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + output])
        locations = intervention_locations([len(prompt)], position, args["share_weights"], num_layers,
                                          pad_position=None)
        with torch.no_grad():
            _, outputs = reft_model({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})
        logits = outputs.logits[0, len(prompt) - 1 : -1]
        loss_sum += F.cross_entropy(logits.double(), ids[0, len(prompt) :], reduction="sum").item()
        label_tokens += len(output)
    return loss_sum / label_tokens


def assert_within_rounding(actual: list[torch.Tensor], expected: list[torch.Tensor],
                           truth: list[torch.Tensor]) -> None:
    """`actual` and `expected`: one float32 computation in two orders; `truth`: `expected`'s in float64. Each
    actual tensor is within NOISE_MARGIN times that expected tensor's rounding error (relative, in norm) of it:
    see NOISE_MARGIN. Per tensor, as a gradient that is rounding noise alone (a rotation's, where the loss is
    flat) errs by ~1 and says nothing of the others."""
    for index, (a, e, t) in enumerate(zip(actual, expected, truth, strict=True)):
        deviation, tolerance = relative_deviation(a, e), NOISE_MARGIN * max(FLOAT32_ROUNDING, relative_deviation(e, t))
        assert deviation <= tolerance, (index, deviation, tolerance)


def assert_reproduces_eval_loss(logged: float, run_dir, model_dir, records) -> None:
    """A logged eval loss is the loss `reloaded_eval_loss` computes from the saved interventions: both are float32
    forwards of one model, batched and one example at a time, so they are within NOISE_MARGIN times the
    float32 error of the reloaded loss, measured against the same loss on the base in float64."""
    reloaded, truth = (torch.tensor([reloaded_eval_loss(run_dir, model_dir, records, dtype)])
                       for dtype in (torch.float32, torch.float64))
    assert_within_rounding([torch.tensor([logged])], [reloaded], [truth])


def eval_losses(directory) -> dict[int, float]:
    return {record["step"]: record["eval_loss"] for record in read_metrics(directory) if "eval_loss" in record}


COMPARED = ("loss", "grad_norm", "eval_loss")
# How far apart two runs of one model may end when their arithmetic differs (1 and N processes, packing, another
# strategy, compiled kernels) is measured in each comparison, never fitted to one CPU: the expected run is
# trained again one precision up (float64 for float32, float32 for bf16; `truth_run`), and its distance to that
# truth, per compared quantity and at its largest over the steps (or tensors), is the rounding error of this
# model, these flags and this CPU's kernels. The compared run carries an error of the same kind, so the two runs
# are at most the sum of the two errors apart: twice the expected run's, and NOISE_MARGIN allows a run to err
# twice as much as the expected one. The float32 errors found this way are 1e-7 to 1e-5 (relative); a
# wrong gradient scale, a lost or doubled micro-batch, a placeholder that draws dropout or a wrong rank's
# share moves a loss, a gradient norm or a weight by 1e-3 or more.
NOISE_MARGIN = 4
# No float32 value is nearer its truth than half a spacing, 2^-24 relative: the floor of any measured error.
FLOAT32_ROUNDING = 2.0**-24
# Tests that compute in float64 throughout (the loss's weighting, DeepSpeed's linear): the same sums in another
# order (micro-batches, ranks, packs) agree to about the number of terms times 2^-53, below 1e-13 for the few
# thousand terms here, on any CPU. 1e-10 leaves a factor of 1000; the errors these tests exist for (a mean of
# micro-batch means, a padded position counted, a gradient lost) move the results by 1e-3 or more.
FLOAT64_RTOL = 1e-10
FLOAT64_ATOL = 1e-12  # for entries near zero, whose relative error has no bound
ONE_PRECISION_UP = {"bfloat16": "float32", "float16": "float32", "float32": "float64", "auto": "float64"}


def logged_values(directory) -> dict[str, dict[int, float]]:
    """Per logged step: the training loss, the gradient norm before clipping, and the eval loss."""
    records = read_metrics(directory)
    return {key: {record["step"]: record[key] for record in records if key in record} for key in COMPARED}


def relative_deviation(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """In norm, in float64 (0 for equal tensors, zeros included)."""
    if torch.equal(actual.double(), expected.double()):
        return 0.0
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def relative_deviations(actual_dir, expected_dir) -> dict[str, float]:
    """The largest relative deviation of one run from another: over the saved tensors, and over the steps of each
    logged value."""
    actual, expected = intervention_weights(actual_dir), intervention_weights(expected_dir)
    deviations = {"weights": max(relative_deviation(actual[key], tensor) for key, tensor in expected.items()
                                 if tensor.is_floating_point())}
    actual_log, expected_log = logged_values(actual_dir), logged_values(expected_dir)
    for key in COMPARED:
        deviations[key] = max((abs(actual_log[key][step] - value) / abs(value)
                               for step, value in expected_log[key].items()), default=0.0)
    return deviations


def saved_arguments(run_dir) -> dict:
    """A run's resolved arguments, as it saved them."""
    return json.loads((Path(run_dir) / ARGS_FILE).read_text())


def saved_command_line(run_dir) -> list[str]:
    """The flags that reproduce a run, rebuilt from its training_args.json (those that differ from the default)."""
    from alpaca.args import build_parser

    saved = saved_arguments(run_dir)
    argv = []
    for action in build_parser("train.py")._actions:
        value = saved.get(action.dest, action.default)
        if not action.option_strings or value == action.default or action.dest in ("bf16", "fp16"):
            continue
        if isinstance(value, dict):
            value = ",".join(f"{name}={field}" for name, field in value.items())
        argv += [action.option_strings[0], str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


RERUNS: dict[tuple[str, ...], Path] = {}  # by process count and flags: runs of one model share their reruns
QUANTIZATION = {"--load_in_4bit", "--load_in_8bit", "--bnb_4bit_quant_type", "--bnb_4bit_use_double_quant"}


def rerun(run_dir, dtype: str, unquantized: bool = False) -> Path:
    """The run in `run_dir` trained again in `dtype` (once per session): the same flags, on one process with the
    accumulation that keeps the global batch, unless dropout draws its masks on each rank, where on the run's
    number of processes. The flags that change no arithmetic (sharding, resuming, compiling, loader workers,
    sample answers) are dropped: a rerun is a plain uninterrupted run; `unquantized` drops the quantization."""
    run_dir = Path(run_dir)
    saved = saved_arguments(run_dir)
    dropped = {"--output_dir", "--dtype", "--resume_from_checkpoint", "--deepspeed", "--fsdp", "--torch_compile",
               "--gradient_accumulation_steps", "--dataloader_num_workers", "--num_sample_answers", "--report_to",
               "--overwrite_output_dir", *(QUANTIZATION if unquantized else ())}
    argv = saved_command_line(run_dir)
    kept = [token for name, value in zip(argv[::2], argv[1::2]) if name not in dropped for token in (name, value)]
    processes = saved["world_size"] if saved["dropout"] > 0 else 1
    accumulation = saved["gradient_accumulation_steps"] * saved["world_size"] // processes
    rerun_flags = [*kept, "--dtype", dtype, "--gradient_accumulation_steps", str(accumulation),
                   "--num_sample_answers", "0"]
    key = (str(processes), *rerun_flags)
    if key not in RERUNS:
        rerun_dir = run_dir.with_name(f"{run_dir.name}-{dtype}{'-unquantized' if unquantized else ''}")
        if processes == 1:
            status, _, stderr = run_in_process("train.py", [*rerun_flags, "--output_dir", rerun_dir])
            assert status == 0, stderr[-3000:]
        else:
            result = torchrun(processes, ["train_multigpu.py", *rerun_flags, "--output_dir", str(rerun_dir)])
            assert result.returncode == 0, result.stderr[-3000:]
        RERUNS[key] = rerun_dir
    return RERUNS[key]


def truth_run(run_dir) -> Path:
    """The run in `run_dir` trained again one precision up (`rerun`)."""
    return rerun(run_dir, ONE_PRECISION_UP[saved_arguments(run_dir)["dtype"]])


def rounding_tolerances(run_dir, truth_dir=None) -> dict[str, float]:
    """How far a run may be from `run_dir`'s run when only the order of its float arithmetic differs: NOISE_MARGIN
    times the rounding error of `run_dir`'s run, measured against its truth (`truth_run` unless given). On a
    bitsandbytes-quantized base, which has no float64 path, the error is that of the same float32 arithmetic
    with the base unquantized."""
    saved = saved_arguments(run_dir)
    if truth_dir is None and (saved.get("load_in_4bit") or saved.get("load_in_8bit")):
        run_dir = rerun(run_dir, saved["dtype"], unquantized=True)
    deviations = relative_deviations(run_dir, truth_dir or truth_run(run_dir))
    return {key: NOISE_MARGIN * max(error, FLOAT32_ROUNDING) for key, error in deviations.items()}


def assert_same_run(actual_dir, expected_dir, exact: bool = False, truth_dir=None) -> None:
    """The comparison of every equivalence test: the saved interventions, and the loss, grad norm and eval loss
    at every logged step. `exact` where both runs have the same process count and arithmetic (a resumed run
    and an uninterrupted one): bit-identical; else within `rounding_tolerances` of the expected run (measured
    against `truth_dir`, where a test trains the truth itself).

    The weights alone miss a constant error in the gradient's scale: AdamW divides it out (up to epsilon),
    and the loss is logged before scaling. The gradient norm shows it.
    """
    actual, expected = intervention_weights(actual_dir), intervention_weights(expected_dir)
    assert actual.keys() == expected.keys() and actual
    actual_log, expected_log = logged_values(actual_dir), logged_values(expected_dir)
    assert expected_log["loss"] and expected_log["grad_norm"]
    for key in COMPARED:
        assert actual_log[key].keys() == expected_log[key].keys(), key
    if exact:
        for key in expected:
            assert torch.equal(actual[key], expected[key]), key
        for key in COMPARED:
            assert actual_log[key] == expected_log[key], key
        return
    tolerances = rounding_tolerances(expected_dir, truth_dir)
    for key in expected:
        if not expected[key].is_floating_point():
            assert torch.equal(actual[key], expected[key]), key
            continue
        deviation = relative_deviation(actual[key], expected[key])
        assert deviation <= tolerances["weights"], (key, deviation, tolerances["weights"])
    for key in COMPARED:
        assert actual_log[key] == pytest.approx(expected_log[key], rel=tolerances[key], abs=0), (key, tolerances[key])


DEEPSPEED_CONFIGS = REPO / "examples" / "deepspeed"


def deepspeed_config_file(directory, stage: int):
    """The shipped config of `stage` (zero2.json for 1 and 2). Under ZeRO-3 every parameter of the tiny model
    stays partitioned between forwards (DeepSpeed keeps small ones whole, by default below 10 x hidden size)."""
    config = json.loads((DEEPSPEED_CONFIGS / ("zero3.json" if stage == 3 else "zero2.json")).read_text())
    config["zero_optimization"]["stage"] = stage
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = directory / f"zero{stage}.json"
    path.write_text(json.dumps(config))
    return path


RECIPES = REPO / "examples" / "launch"
# python, torchrun and accelerate of the environment running the tests; the global batch of `runs`.
RECIPE_ENV = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "GLOBAL_BATCH": "8",
              "PER_DEVICE": "2"}


def recipe(name: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    """A launch recipe of examples/launch, run as a user runs it, with `args` appended to its flags."""
    return run_script([str(RECIPES / name), *args], launcher=["bash"], env={**RECIPE_ENV, **env})


@pytest.fixture(scope="session")
def runs(tiny_tied_model, tiny_data, tiny_eval_data, tmp_path_factory):
    """One process and two, launched as a user launches them: examples/launch/single_gpu.sh (accumulation 4)
    and multi_gpu.sh (torchrun, accumulation 2; each rank's output in a log file, through torchrun's PET_
    variables). On the tied-embeddings model. 21 examples, global batch 8: the last global batch of each epoch
    is partial (5 examples), and in it rank 1's last micro-batch is empty. Evaluated on 5 held-out examples at
    steps 4, 8 and 9 (the last). Returns the runs' root and the flags given to the recipes."""
    root = tmp_path_factory.mktemp("runs")
    data = training_flags(tiny_tied_model, tiny_data, None, *COMMON, "--eval_data_path", str(tiny_eval_data),
                          "--eval_strategy", "steps", "--eval_steps", "4", "--per_device_eval_batch_size", "2")
    single = recipe("single_gpu.sh", data, {"OUTPUT_DIR": str(root / "single")})
    assert single.returncode == 0, single.stderr[-3000:]
    assert "global batch 8 = 2 per device x 4 accumulation" in single.stdout
    ddp = recipe("multi_gpu.sh", data, {"OUTPUT_DIR": str(root / "ddp"), "NPROC": "2",
                                        "PET_LOG_DIR": str(root / "logs"), "PET_REDIRECTS": "3"})
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    return root, data


@pytest.fixture(scope="session")
def fsdp_runs(runs):
    """The DDP run of `runs` again with --fsdp, ending with sample answers (which need every rank), reporting to
    wandb (offline); through tests/faults.py without a fault, which reports the process-group threads left at
    exit. Returns the runs' root and the launch's result."""
    root, data = runs
    result = torchrun(2, [FAULTS, "train_multigpu.py", *data, "--per_device_train_batch_size", "2",
                          "--gradient_accumulation_steps", "2", "--output_dir", str(root / "fsdp"), "--fsdp",
                          "--num_sample_answers", "2", "--max_new_tokens", "6", "--report_to", "wandb"])
    assert result.returncode == 0, result.stderr[-3000:]
    return root, result


# Dropout makes the RNG part of the state: an exact resume must restore it, and evaluation must switch it off.
# 21 records, 4 held out for evaluation (at steps 4, 8 and 9): 17 to train on, 3 steps an epoch (8, 8, 1), so
# checkpoint-2, -4 and -8 fall inside an epoch and checkpoint-6 at its end.
FLAGS = [*EQUIVALENCE_RUN, "--dropout", "0.1", "--max_steps", "9", "--save_strategy", "steps", "--save_steps", "2",
         "--per_device_train_batch_size", "2", "--eval_split_ratio", "0.15", "--eval_strategy", "steps",
         "--eval_steps", "4", "--per_device_eval_batch_size", "2"]
# The reference runs' geometry, global batch 8. They log every 2 and every 3 steps, so that a resume restores a
# partial logging window: of one process after a stop signal at step 5 or from checkpoint-3, of two processes
# (summed over the ranks) from checkpoint-4.
SINGLE = ["--gradient_accumulation_steps", "4", "--logging_steps", "2"]
DDP = ["--gradient_accumulation_steps", "2", "--logging_steps", "3"]
FAULTS = str(REPO / "tests" / "faults.py")


# --device_map's layers on disk in its exactness tests: --layers 1;2 intervenes on 1 and 2 (of 0..3)
OFFLOADED = (0, 2)


def disk_map() -> str:
    """A --device_map of the tiny Llama's modules: layers OFFLOADED on disk, the rest in CPU memory."""
    modules = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm", "model.rotary_emb",
               "lm_head"]
    return json.dumps({name: "disk" if name in {f"model.layers.{i}" for i in OFFLOADED} else "cpu"
                       for name in modules})


def flags(tiny_model, tiny_data, output_dir, *extra) -> list[str]:
    """The reference runs' command line (FLAGS), then `extra`."""
    return training_flags(tiny_model, tiny_data, output_dir, *FLAGS, *extra)


@pytest.fixture(scope="session")
def reference(tiny_model, tiny_data, tmp_path_factory):
    """Uninterrupted runs: one process (accumulation 4) and two (accumulation 2); global batch 8."""
    root = tmp_path_factory.mktemp("reference")
    status, _, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, root / "single", *SINGLE))
    assert status == 0, stderr[-3000:]
    ddp = torchrun(2, ["train_multigpu.py", *flags(tiny_model, tiny_data, root / "ddp", *DDP)])
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert [path.name for path in checkpoints(root / "single")] == ["checkpoint-2", "checkpoint-4", "checkpoint-6",
                                                                   "checkpoint-8"]
    assert [r["step"] for r in read_metrics(root / "single") if "loss" in r] == [2, 4, 6, 8, 9]
    assert [r["step"] for r in read_metrics(root / "ddp") if "loss" in r] == [3, 6, 9]
    status, _, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, root / "single-no-dropout",
                                                         "--gradient_accumulation_steps", "4", "--dropout", "0"))
    assert status == 0, stderr[-3000:]
    return root


@pytest.fixture(scope="session")
def pyreft_command_line(tiny_model, tiny_data):
    """The README's command line of pyreft's examples/alpaca, verbatim but for the model, data and layers (the
    tiny model has 4) and without the output directory, plus the two flags pyreft's own argument class adds
    to HF's: global batch 32 = 4 per device x 8 accumulation."""
    documented = readme_command("train.py")
    output_dir = documented.index("--output_dir")
    del documented[output_dir: output_dir + 2]
    replaced = {"--model_name_or_path": str(tiny_model), "--data_path": str(tiny_data), "--layers": LAYERS}
    return [replaced.get(documented[i - 1], token) if i else token for i, token in enumerate(documented)] + [
        "--optim", "adamw_torch", "--remove_unused_columns", "False"]


@pytest.fixture(scope="session")
def pyreft_example_run(pyreft_command_line, tmp_path_factory):
    """train.py on the pyreft command line, with one sample answer: the output directory and what it printed."""
    output_dir = tmp_path_factory.mktemp("pyreft-example")
    status, stdout, stderr = run_in_process("train.py", [*pyreft_command_line, "--output_dir", output_dir,
                                                         "--num_sample_answers", "1", "--max_new_tokens", "8"])
    assert status == 0, stderr[-3000:]
    return output_dir, stdout


DOCUMENTED_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for each command line in the pages' bash blocks: continuations joined, comments dropped."""
    commands = []
    for page in DOCUMENTED_PAGES:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line and not line.startswith("#"):
                    commands.append((page.name, line))
    return commands


def readme_command(script: str) -> list[str]:
    """The arguments of the README's first command line that runs `script`."""
    for page, command in documented_commands():
        tokens = shlex.split(command)
        if page == "README.md" and tokens[:2] == ["python", script] and "..." not in tokens:
            return tokens[2:]
    raise AssertionError(f"README.md shows no full command line of {script}")
