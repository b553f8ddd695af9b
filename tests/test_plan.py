"""--plan: the scripts' own step on fake GPUs (alpaca.plan). Each plan runs in a fresh interpreter: on a CPU build of
torch it starts itself again with the fake CUDA library preloaded."""

import json
import re

import pytest
from conftest import build_tiny_model, deepspeed_config_file, free_port, run_script, write_records

GiB = 2**30
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                 tie_word_embeddings=False)


def llama_config(directory, **fields):
    """A directory holding only a Llama config.json: no tokenizer, no weights."""
    from transformers import LlamaConfig

    LlamaConfig(**fields).save_pretrained(directory)
    return directory


def planned(result) -> dict[str, float]:
    """The plan's figures, in GiB, by the words its lines start with."""
    assert result.returncode == 0, result.stderr[-3000:]
    figures = {}
    for name in ("base model", "interventions", "activations", "communication", "peak GPU memory"):
        match = re.search(rf"^  {name}.*?(-?\d+\.\d+) GiB", result.stdout, re.MULTILINE)
        assert match, result.stdout
        figures[name] = float(match.group(1))
    return figures


def parameter_bytes(fields: dict) -> int:
    """The bfloat16 bytes of a Llama model's parameters, counted from its shapes."""
    hidden, inner, layers, vocab = (fields[key] for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                          "vocab_size"))
    head_dim = hidden // fields["num_attention_heads"]
    kv = fields["num_key_value_heads"] * head_dim
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner + 2 * hidden  # attention, MLP, 2 norms
    return 2 * (layers * per_layer + vocab * hidden * (1 if fields["tie_word_embeddings"] else 2) + hidden)


def test_a_70b_plan_at_world_size_8_shards_the_base_exactly(tmp_path):
    """The Llama-3.1-70B shapes at world size 8 under --fsdp: each rank's base is the parameters' bytes over 8,
    and two steps of 1 x 64 tokens fit in 80 GB."""
    model = llama_config(tmp_path / "llama-70b", **LLAMA_70B)
    result = run_script(["train_multigpu.py", "--model_name_or_path", str(model), "--fsdp", "--plan", "8x80GB",
                         "--layers", "8;19", "--per_device_train_batch_size", "1", "--model_max_length", "64",
                         "--output_dir", str(tmp_path / "out")], timeout=900)
    figures = planned(result)
    assert "(the model has no tokenizer)" in result.stdout
    base_shard = parameter_bytes(LLAMA_70B) / 8 / GiB
    assert figures["base model"] == pytest.approx(base_shard, abs=0.0006)  # printed to 3 decimals
    assert "Verdict: fits." in result.stdout
    assert not (tmp_path / "out").exists()


def test_a_plan_that_does_not_fit_names_what_to_try(tmp_path):
    """The tiny model's FSDP plan on GPUs of 1 MB: over, with --gradient_checkpointing among the flags to try;
    on 1 GB it fits, with the data's longest examples as the step."""
    model = build_tiny_model(tmp_path / "tiny")
    data = write_records(tmp_path / "data.json", 16)
    common = ["train_multigpu.py", "--model_name_or_path", str(model), "--data_path", str(data), "--layers", "1;2",
              "--fsdp", "--output_dir", str(tmp_path / "out")]
    small = run_script([*common, "--plan", "2x1MB"])
    assert small.returncode == 0, small.stderr[-3000:]
    assert "Verdict: does not fit." in small.stdout and "--gradient_checkpointing" in small.stdout
    fits = run_script([*common, "--plan", "2x1GB"])
    assert "Verdict: fits." in fits.stdout and "longest examples of the data" in fits.stdout
    assert planned(fits)["peak GPU memory"] > 0


def test_train_py_plans_one_gpu_and_its_peak_grows_with_the_batch(tmp_path):
    """train.py's plan on one GPU: twice the micro-batch, more activations, the same base; a plan of more GPUs is
    refused with one line."""
    model = llama_config(tmp_path / "config-only", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    common = ["train.py", "--model_name_or_path", str(model), "--layers", "1;2", "--model_max_length", "128",
              "--plan", "1x80GB", "--output_dir", str(tmp_path / "out")]
    one, two = (planned(run_script([*common, "--per_device_train_batch_size", size])) for size in ("4", "8"))
    assert one["base model"] == two["base model"] > 0
    assert two["activations"] > 1.5 * one["activations"]
    several = run_script([*common, "--plan", "2x80GB"])
    assert several.returncode == 2 and several.stderr.strip().splitlines() == [
        "train.py: error: train.py trains on one process: plan it with --plan 1x<MEMORY> (with --device_map "
        "<GPUS>x<MEMORY>), or plan N GPUs with train_multigpu.py"], several.stderr[-2000:]


def test_a_4bit_base_is_planned_as_bitsandbytes_stores_it(tmp_path):
    """train.py's plan of a 4-bit NF4 base: each linear layer of the decoder's weights in 4 bits with a float32 scale
    per block of 64 (9/16 of a byte a value), the embeddings, the LM head and the norms in bf16; a bf16 plan that
    does not fit names --load_in_4bit among the flags to try."""
    fields = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=1000)
    model = llama_config(tmp_path / "config-only", **fields)
    common = ["train.py", "--model_name_or_path", str(model), "--layers", "1;2", "--model_max_length", "64",
              "--bf16", "--output_dir", str(tmp_path / "out")]
    quantized = planned(run_script([*common, "--load_in_4bit", "--plan", "1x80GB"]))
    hidden, inner, layers = fields["hidden_size"], fields["intermediate_size"], fields["num_hidden_layers"]
    linear_values = layers * (4 * hidden * hidden + 3 * hidden * inner)
    unquantized_values = 2 * fields["vocab_size"] * hidden + (2 * layers + 1) * hidden
    assert quantized["base model"] == pytest.approx((linear_values * 9 / 16 + 2 * unquantized_values) / GiB,
                                                    abs=0.0006)  # printed to 3 decimals
    over = run_script([*common, "--plan", "1x1MB"])
    assert "Verdict: does not fit." in over.stdout and "--load_in_4bit (the base in 4 bits" in over.stdout


@pytest.mark.parametrize("flags, message", [
    (["--plan", "8x80"], "--plan '8x80': expected [NODESx]GPUSxMEMORY"),
    (["--plan", "0x80GB"], "at least 1 node and 1 GPU"),
    (["--plan", "8x80GB", "--model_name_or_path", "MISSING"], "cannot read the config"),
    (["--plan", "8x80GB", "--model_name_or_path", "EMPTY"], "cannot read the config"),
    (["--plan", "8x80GB", "--device_map", "auto", "--load_in_4bit"], "does not plan --device_map with a quantized"),
    (["--plan", "8x80GB", "--device_map", '{"": "disk"}', "--offload_folder", "OFFLOAD"], "modules on 'disk'"),
    (["--plan", "8x80GB", "--load_in_4bit", "--fsdp"], "does not plan --fsdp --load_in_4bit"),
    (["--plan", "8x80GB", "--load_in_8bit"], "does not plan --load_in_8bit"),
    (["--plan", "8x80GB", "--packing"], "does not plan --packing"),
    (["--plan", "8x80GB", "--torch_compile"], "does not plan --torch_compile"),
])
def test_bad_plans_end_with_one_line(flags, message, tmp_path):
    """An unparsable GPU memory, an empty world, a model without a readable config, and what a plan cannot run or
    does not run (packs, a compiled step): one line, exit 2, nothing written."""
    (tmp_path / "empty").mkdir()
    model = llama_config(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    paths = {"MISSING": tmp_path / "missing", "EMPTY": tmp_path / "empty", "OFFLOAD": tmp_path / "offload"}
    flags = [str(paths[flag]) if flag in paths else flag for flag in flags]
    if "--model_name_or_path" not in flags:
        flags += ["--model_name_or_path", str(model)]
    result = run_script(["train_multigpu.py", "--layers", "0", "--output_dir", str(tmp_path / "out"), *flags])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert not (tmp_path / "out").exists() and not (tmp_path / "offload").exists()
    assert json.loads((model / "config.json").read_text())["hidden_size"] == 64  # the model untouched


def same_length_records(path, count: int):
    """Records all of one length: every step of a real run is the plan's longest step."""
    record = {"instruction": "Name three colors of the rainbow and say why the sky is blue.", "input": "",
              "output": "Red, orange and yellow; sunlight scatters off the air, blue most of all."}
    path.write_text(json.dumps([record] * count))
    return path


@pytest.mark.parametrize("script, strategy", [
    ("train.py", []), ("train_multigpu.py", []), ("train_multigpu.py", ["--fsdp"]),
    ("train_multigpu.py", ["--load_in_4bit", "--bnb_4bit_use_double_quant"])])
def test_the_planned_peak_is_a_real_runs_peak(script, strategy, tmp_path):
    """The plan's peak on fake GPUs against the same tracker around the same two steps of a real run on CPU (one
    process; DDP and --fsdp: two, gloo), in float32 with eager attention (SDPA picks other kernels on a GPU than on
    a CPU); both add what the tracker does not follow (alpaca.plan.untraced_bytes: DDP's buckets, --fsdp's
    interventions, a 4-bit base's quantization constants).

    Bound: what the two place differently. The plan copies the step's micro-batch (input ids, attention mask,
    labels: int64) to the GPU, where the CPU run's collator writes it in the traced memory too, so at most one
    micro-batch's bytes; under --fsdp, FSDP2 on a GPU keeps a unit's all-gather buffer until the next unit
    gathers, where the CPU run frees it at once (alpaca.strategy.drop_deferred_all_gather): the largest unit's
    bytes, the embedding matrix."""
    model = build_tiny_model(tmp_path / "tiny")
    data = same_length_records(tmp_path / "data.json", 16)
    flags = ["--model_name_or_path", str(model), "--data_path", str(data), "--layers", "1;2", "--dtype", "float32",
             "--per_device_train_batch_size", "4", "--max_steps", "2", "--num_sample_answers", "0",
             "--pad_to_multiple_of", "64", "--attn_implementation", "eager", *strategy]
    distributed = script == "train_multigpu.py"
    launcher = (["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
                if distributed else [])
    real = run_script([*launcher, "tests/traced_run.py", script, *flags, "--output_dir", str(tmp_path / "real")])
    assert real.returncode == 0, real.stderr[-3000:]
    [real_peak] = map(int, re.findall(r"traced peak of rank 0: (\d+) bytes", real.stdout))
    plan = run_script([script, *flags, "--plan", f"{2 if distributed else 1}x1GB", "--output_dir", str(tmp_path / "p")])
    assert plan.returncode == 0, plan.stderr[-3000:]
    planned_peak = int(re.search(r"headroom; (\d+) bytes", plan.stdout).group(1))
    width = int(re.search(r"of 4 x (\d+) tokens", plan.stdout).group(1))
    config = json.loads((model / "config.json").read_text())
    bound = 3 * 4 * width * 8 + (config["vocab_size"] * config["hidden_size"] * 4 if "--fsdp" in strategy else 0)
    assert abs(planned_peak - real_peak) <= bound, (planned_peak, real_peak, bound)


@pytest.mark.parametrize("stage, rank", [(2, 32), (3, 4)])
def test_a_zero_plan_bounds_a_real_runs_peak(stage, rank, tmp_path):
    """DeepSpeed's engine cannot run on fake tensors: a ZeRO plan runs DDP's step (ZeRO-3: --fsdp's) and counts the
    model states by DeepSpeed's layout (alpaca.plan.zero_parts). Against the same tracker around a real ZeRO run
    on 2 gloo processes (plus ZeRO-3's partitions, which the tracker does not follow), the plan is never below the
    real peak, and above it by at most what it counts at its most or places differently (derived here):
    - one micro-batch of int64 input ids, attention mask and labels (test_the_planned_peak_is_a_real_runs_peak);
    - everything ZeRO holds for the trainable values, counted all at once: their parameters and a whole gradient,
      the partitions of their float32 copy, gradient and AdamW's two moments (and of the parameters under ZeRO-3),
      and the two reduce buckets of overlap_comm (each holding every trainable value);
    - under ZeRO-3, --fsdp's gathered unit and its all-gather buffer, where DeepSpeed gathers one module: two
      copies of the largest unit (a decoder layer or the embedding matrix); and the LM head, which the plan holds
      gathered across the loss as DeepSpeed does whether or not the peak is there.
    Each stage at a rank where what its formula adds weighs more than the bound's slack: a ZeRO-2 plan that dropped
    the trainable states (--rank 32), a ZeRO-3 plan that left the base unpartitioned or counted nothing gathered
    (--rank 4: a smaller slack for the trainable values), fails it."""
    model = build_tiny_model(tmp_path / "tiny")
    data = same_length_records(tmp_path / "data.json", 16)
    flags = ["train_multigpu.py", "--model_name_or_path", str(model), "--data_path", str(data), "--layers", "1;2",
             "--dtype", "float32", "--per_device_train_batch_size", "4", "--max_steps", "2", "--num_sample_answers",
             "0", "--pad_to_multiple_of", "64", "--attn_implementation", "eager", "--rank", str(rank),
             "--deepspeed", str(deepspeed_config_file(tmp_path, stage))]
    real = run_script(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                       "tests/traced_run.py", *flags, "--output_dir", str(tmp_path / "real")])
    assert real.returncode == 0, real.stderr[-3000:]
    [real_peak] = map(int, re.findall(r"traced peak of rank 0: (\d+) bytes", real.stdout))
    plan = run_script([*flags, "--plan", "2x1GB", "--output_dir", str(tmp_path / "p")])
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "its model states are counted by formula" in plan.stdout
    planned_peak = int(re.search(r"headroom; (\d+) bytes", plan.stdout).group(1))
    width = int(re.search(r"of 4 x (\d+) tokens", plan.stdout).group(1))
    config = json.loads((model / "config.json").read_text())
    hidden = config["hidden_size"]
    trainable = 4 * (2 * hidden * rank + rank) * 4  # 2 layers x 2 positions of LoReFT: rotation, source, bias
    layer = (2 * hidden * hidden + 2 * hidden * config["num_key_value_heads"] * config["head_dim"]
             + 3 * hidden * config["intermediate_size"] + 2 * hidden) * 4
    embedding = config["vocab_size"] * hidden * 4
    gathered = 2 * max(layer, embedding) + embedding if stage == 3 else 0
    bound = 3 * 4 * width * 8 + (2 + 4 / 2 + (stage == 3) / 2 + 2) * trainable + gathered
    assert real_peak <= planned_peak <= real_peak + bound, (planned_peak, real_peak, bound)


# Defects of the kind NCCL refuses and gloo on CPU accepts, each planted in a copy of the code the plan runs.
PLANTED = {  # a defect: (what plants it, the call site it fails at, the device of the tensor it gives NCCL)
    "the interventions' gradients averaged in host memory": (
        "import torch; flatten = torch._utils._flatten_dense_tensors; "
        "torch._utils._flatten_dense_tensors = lambda tensors: flatten(tensors).cpu()",
        "alpaca/strategy.py", "average_gradients", "cpu"),
    "the replicas' checksums compared in host memory": (
        "import inspect, alpaca.strategy as s; "
        "exec(inspect.getsource(s.check_replicated).replace('.to(device)', '.cpu()'), vars(s))",
        "<string>", "check_replicated", "cpu"),
    "the process group bound to one GPU of a rank's device map": (
        "import torch, alpaca.distributed as d; d.bound_device = lambda gpus: torch.device('cuda', gpus[0])",
        "alpaca/strategy.py", "wrap", "cuda:1"),
}
# the tiny model's two layers on a rank's two GPUs, its first on the CPU between forwards
TWO_GPU_MAP = json.dumps({"model.embed_tokens": 0, "model.layers.0": "cpu", "model.layers.1": 1, "model.norm": 1,
                          "model.rotary_emb": 1, "lm_head": 1})


@pytest.mark.parametrize("defect, strategy, plan", [(defect, ["--fsdp"], "8x80GB") for defect in list(PLANTED)[:2]] + [
    ("the replicas' checksums compared in host memory", [], "8x80GB"),
    ("the process group bound to one GPU of a rank's device map", ["--device_map", TWO_GPU_MAP], "8x2x80GB")])
def test_a_collective_off_the_ranks_gpu_fails_the_plan_at_its_call_site(defect, strategy, plan, tmp_path):
    """Each planted defect makes the --fsdp plan (and DDP's, for the code DDP runs; DDP's over a device map of two
    GPUs a rank, for its process group's binding) at world size 8 fail with one line naming the collective's call
    site and the device; without it the same plans pass (test_a_plan_that_does_not_fit_names_what_to_try,
    test_the_planned_peak_is_a_real_runs_peak, test_a_device_map_plan_holds_each_gpus_part_of_the_base)."""
    plant, path, function, device = PLANTED[defect]
    model = llama_config(tmp_path / "model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    runner = f"import runpy, sys; {plant}; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    result = run_script(["-c", runner, "train_multigpu.py", "--model_name_or_path", str(model), "--layers", "0;1",
                         *strategy, "--plan", plan, "--model_max_length", "32",
                         "--output_dir", str(tmp_path / "out")])
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert re.search(rf"a collective \(\w+\) at {path}:\d+ \({function}\) is given a tensor on {device}, where NCCL "
                     r"takes only the rank's cuda:0", line), line


def test_a_device_map_plan_holds_each_gpus_part_of_the_base(tmp_path):
    """DDP at world size 8 over a device map of two GPUs a rank (TWO_GPU_MAP's modules: the embeddings on the first,
    the first layer in CPU memory, the rest on the second): the plan names each GPU's peak, the fullest (the second,
    which holds the logits) holds exactly its modules' parameters, and its collectives pass NCCL's rule for a group
    bound to no GPU."""
    fields = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4000, tie_word_embeddings=False)
    model = llama_config(tmp_path / "model", **fields)
    result = run_script(["train_multigpu.py", "--model_name_or_path", str(model), "--layers", "0;1", "--device_map",
                         TWO_GPU_MAP, "--plan", "8x2x80GB", "--model_max_length", "64",
                         "--output_dir", str(tmp_path / "out")])
    figures = planned(result)
    one_layer = (parameter_bytes({**fields, "num_hidden_layers": 1, "vocab_size": 0}) - 2 * fields["hidden_size"])
    second_gpu = one_layer + 2 * fields["vocab_size"] * fields["hidden_size"] + 2 * fields["hidden_size"]
    assert "on its GPUs cuda:0: " in result.stdout and "its fullest, cuda:1, holds" in result.stdout
    assert figures["base model"] == pytest.approx(second_gpu / GiB, abs=0.0006)  # printed to 3 decimals
    assert "collectives all took tensors on the rank's GPUs" in result.stdout
    assert not (tmp_path / "out").exists()


def test_fsdp_offload_plans_the_shards_off_the_gpu(tmp_path):
    """--fsdp offload keeps the shards in CPU memory: the GPU holds none of the base between its gathers, and its
    peak is lower by at least the shard; without offload the shard is the parameters' bytes over the world."""
    fields = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4000, tie_word_embeddings=False)
    model = llama_config(tmp_path / "model", **fields)
    common = ["train_multigpu.py", "--model_name_or_path", str(model), "--layers", "1;2", "--model_max_length", "64",
              "--plan", "2x80GB", "--output_dir", str(tmp_path / "out")]
    sharded = planned(run_script([*common, "--fsdp"]))
    offloaded = planned(run_script([*common, "--fsdp", "full_shard offload"]))
    assert sharded["base model"] == pytest.approx(parameter_bytes(fields) / 2 / GiB, abs=0.0006)
    assert offloaded["base model"] == 0
    assert offloaded["peak GPU memory"] <= sharded["peak GPU memory"] - sharded["base model"] + 0.001


def test_the_fake_cuda_library_is_built_once_for_each_source(tmp_path, monkeypatch):
    """The compiled library is cached by torch's version and its source: a changed fake_cuda.cpp is built again,
    an unchanged one is not."""
    from alpaca import fake_cuda

    first = fake_cuda.build_library(str(tmp_path))
    changed = tmp_path / "fake_cuda.cpp"
    changed.write_text(fake_cuda.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(fake_cuda, "SOURCE", changed)
    second = fake_cuda.build_library(str(tmp_path))
    built = second.stat().st_mtime_ns
    assert second != first and first.exists()
    assert fake_cuda.build_library(str(tmp_path)) == second and second.stat().st_mtime_ns == built


def test_the_users_preloaded_libraries_stay_preloaded(tmp_path):
    """The plan starts itself again with its library preloaded before the user's; then the processes it starts get
    the user's LD_PRELOAD back, without its own."""
    program = ("import os, sys; sys.path.insert(0, '.'); from alpaca import fake_cuda; "
               f"fake_cuda.run_with_fake_cuda({str(tmp_path)!r}); print('preloaded:', os.environ['LD_PRELOAD'])")
    result = run_script(["-c", program], env={"LD_PRELOAD": "libm.so.6"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "preloaded: libm.so.6"


def test_grouped_key_value_heads_are_planned_with_the_kernels_a_gpu_runs(tmp_path):
    """One key/value head for 4 query heads against 4 of each, one GPU, 8 x 512 tokens: in bfloat16 flash attention
    takes the grouped heads as they are (less memory than 4 key/value heads, where repeating them would hold more);
    in float32 the memory-efficient kernel takes no grouped heads and a GPU runs the math path, which holds the
    attention probabilities of the layer the backward runs through (8 x 4 x 512 x 512 in float32; the other layer
    is below every intervention): more than half that matrix above the 4-head plan, which the efficient kernel
    serves with none."""
    peaks = {}
    for heads in (1, 4):
        model = llama_config(tmp_path / f"kv{heads}", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=heads, vocab_size=1000)
        for dtype in ("bfloat16", "float32"):
            result = run_script(["train.py", "--model_name_or_path", str(model), "--layers", "0;1", "--dtype", dtype,
                                 "--model_max_length", "512", "--plan", "1x80GB", "--output_dir", str(tmp_path / "o")])
            assert result.returncode == 0, result.stderr[-3000:]
            peaks[heads, dtype] = int(re.search(r"headroom; (\d+) bytes", result.stdout).group(1))
    assert peaks[1, "bfloat16"] < peaks[4, "bfloat16"], peaks
    assert peaks[1, "float32"] - peaks[4, "float32"] > 8 * 4 * 512 * 512 * 4 / 2, peaks
