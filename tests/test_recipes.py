"""The launch recipes in examples/launch, run the way a user runs them (here on CPU, gloo): each trains the
model that one process trains with the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    DDP,
    RECIPE_ENV,
    RECIPES,
    REPO,
    assert_same_run,
    disk_map,
    flags,
    free_port,
    intervention_weights,
    recipe,
    run_in_process,
    run_script,
)

from alpaca.args import parse_args

DEEPSPEED = REPO / "examples" / "deepspeed"


def plan_batch(processes: int) -> subprocess.CompletedProcess:
    """common.sh's plan_batch for GLOBAL_BATCH=32 with at most 8 per GPU; prints BATCH_FLAGS."""
    shell = f'source examples/launch/common.sh && plan_batch {processes} && echo "${{BATCH_FLAGS[*]}}"'
    return subprocess.run(["bash", "-c", shell], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "GLOBAL_BATCH": "32", "PER_DEVICE": "8"})


@pytest.mark.parametrize("processes,per_device,accumulation", [(1, 8, 4), (4, 8, 1), (8, 4, 1), (16, 2, 1)])
def test_recipes_keep_the_global_batch_on_any_gpu_count(processes, per_device, accumulation):
    """From 1 GPU to 2 nodes of 8."""
    result = plan_batch(processes)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["--per_device_train_batch_size", str(per_device),
                                     "--gradient_accumulation_steps", str(accumulation)]


def test_recipes_refuse_a_global_batch_they_cannot_keep():
    result = plan_batch(64)
    assert result.returncode == 2 and "GLOBAL_BATCH=32 cannot be split evenly over 64 processes" in result.stderr


def test_the_one_and_two_process_runs_come_from_their_recipes(runs):
    """`runs`, which the equivalence tests compare (test_multigpu.py: the same model, rank 0 alone prints), is
    single_gpu.sh and multi_gpu.sh: their flags are in the runs' arguments."""
    root, _ = runs
    for name, processes, accumulation in (("single", 1, 4), ("ddp", 2, 2)):
        args = json.loads((root / name / "training_args.json").read_text())
        assert (args["save_steps"], args["world_size"], args["gradient_accumulation_steps"]) == (
            100, processes, accumulation)


def test_device_map_recipe_on_two_ranks_trains_the_ddp_run_exactly(runs, tmp_path):
    """examples/launch/device_map.sh with 2 processes, each placing the tied-embeddings model with layers on disk:
    DDP over the spread module trains `runs`' two-rank run bit for bit (evaluated at steps 4, 8, 9), and the sample
    answers at the end run through the map."""
    root, data = runs
    result = recipe("device_map.sh", [*data, "--num_sample_answers", "1", "--max_new_tokens", "4"],
                    {"OUTPUT_DIR": str(tmp_path / "map"), "NPROC": "2", "DEVICE_MAP": disk_map(),
                     "OFFLOAD_FOLDER": str(tmp_path / "offload")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x 2 accumulation" in result.stdout and "REFT MODEL" in result.stdout
    assert "replicated (DDP), on each rank by --device_map (cpu: 6 modules, disk: 2 modules)" in result.stdout
    assert_same_run(tmp_path / "map", root / "ddp", exact=True)


def test_accelerate_recipe_trains_the_model_of_one_process(runs):
    root, data = runs
    output_dir = root / "recipe-accelerate"
    # a port of its own (accelerate's default is torchrun's): the tests run side by side
    result = recipe("accelerate.sh", data, {"OUTPUT_DIR": str(output_dir), "MASTER_PORT": str(free_port()),
                                            "NPROC": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x 2 accumulation" in result.stdout
    assert_same_run(output_dir, root / "single")


@pytest.mark.parametrize("strategy,variables,layout", [
    ("deepspeed", {"DEEPSPEED_CONFIG": str(REPO / "examples" / "deepspeed" / "zero2.json")},
     "base model replicated (DeepSpeed ZeRO-2)"),
    ("fsdp", {"FSDP": "1"}, "base model sharded (FSDP)"),
], ids=["deepspeed", "fsdp"])
def test_accelerate_deepspeed_and_fsdp_run_them(runs, strategy, variables, layout):
    """`accelerate launch --use_deepspeed --deepspeed_config_file zero2.json` and `--use_fsdp` (the recipe with
    DEEPSPEED_CONFIG or FSDP) run the script's ZeRO-2 and FSDP, as --deepspeed and --fsdp would, not DDP: the
    model of one process."""
    root, data = runs
    output_dir = root / f"recipe-accelerate-{strategy}"
    result = recipe("accelerate.sh", data, {"OUTPUT_DIR": str(output_dir), "MASTER_PORT": str(free_port()),
                                            "NPROC": "2", **variables})
    assert result.returncode == 0, result.stderr[-3000:]
    assert layout in result.stdout, result.stdout[-2000:]
    assert_same_run(output_dir, root / "single")


@pytest.mark.parametrize("script,variables,flags,message", [
    ("train_multigpu.py", {"ACCELERATE_USE_DEEPSPEED": "true"}, [],
     "accelerate launch --use_deepspeed without --deepspeed_config_file: ZeRO's settings come from a DeepSpeed "
     "config here; add --deepspeed_config_file examples/deepspeed/zero2.json (or pass --deepspeed CONFIG.json to "
     "the script)"),
    ("train.py", {"ACCELERATE_USE_FSDP": "true"}, [],
     "accelerate launch --use_fsdp: train.py trains on one device; launch train_multigpu.py with the same flags"),
    ("train.py", {"ACCELERATE_MIXED_PRECISION": "fp8"}, [],
     "accelerate's mixed_precision fp8 (its --mixed_precision or its config file): these scripts train in bf16, "
     "fp16 or float32; launch with --mixed_precision bf16, or with no and pass --dtype"),
    ("train_multigpu.py", {"ACCELERATE_MIXED_PRECISION": "bf16"}, ["--dtype", "float32"],
     "accelerate's mixed_precision bf16 (its --mixed_precision or its config file) and --dtype float32 differ; "
     "pass one of them"),
    ("train.py", {"ACCELERATE_MIXED_PRECISION": "fp16"}, ["--bf16"],
     "accelerate's mixed_precision fp16 (its --mixed_precision or its config file) and --bf16 differ; pass one "
     "of them"),
    ("train_multigpu.py", {"ACCELERATE_MIXED_PRECISION": "fp16"}, ["--deepspeed", DEEPSPEED / "zero2.json"],
     "accelerate's mixed_precision fp16 (its --mixed_precision or its config file) under --deepspeed: a float16 "
     "base needs loss scaling, which these scripts do not run; launch with --mixed_precision bf16"),
    ("train.py", {"ACCELERATE_DYNAMO_BACKEND": "AOT_EAGER"}, [],
     "accelerate's dynamo_backend aot_eager (its --dynamo_backend or its config file): --torch_compile compiles "
     "with inductor only; launch with --dynamo_backend inductor, or no"),
    ("train_multigpu.py", {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_USE_FSDP": "true"}, [],
     "accelerate's dynamo_backend inductor (its --dynamo_backend or its config file) means --torch_compile here, "
     "not yet tested with --fsdp (sharded weights); launch with --dynamo_backend no"),
], ids=["deepspeed without a config", "train.py", "fp8", "bf16 against --dtype", "fp16 against --bf16",
        "fp16 under deepspeed", "another dynamo backend", "inductor with fsdp"])
def test_accelerate_modes_the_scripts_cannot_follow_are_refused(tiny_model, tiny_data, tmp_path, monkeypatch, script,
                                                               variables, flags, message):
    """What accelerate launch sets for them (accelerate's own DeepSpeed settings, from its flags, without a
    config file; any strategy of train.py, a one-device script; a precision or compiler they do not have, or
    one a flag contradicts): one line, before anything is written."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    status, _, stderr = run_in_process(script, ["--model_name_or_path", tiny_model, "--data_path", tiny_data,
                                                "--output_dir", tmp_path / "out", *flags])
    assert status == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("launch_flags,dtype,compiled", [
    (["--mixed_precision", "bf16", "--dynamo_backend", "inductor"], "bfloat16", True),
    (["--mixed_precision", "fp16"], "float16", False),
    (["--mixed_precision", "no", "--dynamo_backend", "no"], "auto", False),
], ids=["bf16 compiled", "fp16", "neither"])
def test_accelerate_precision_and_dynamo_are_read_as_the_scripts_flags(tmp_path, launch_flags, dtype, compiled):
    """A real `accelerate launch --mixed_precision ... --dynamo_backend ...` of a script that parses train.py's
    flags as train.py does: bf16/fp16 arrive as --bf16/--fp16 (HF's Trainer reads them so), inductor as
    --torch_compile, "no" (accelerate's default) as nothing."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
                     "from alpaca.args import parse_args\n"
                     "args = parse_args('train.py', [])\n"
                     "print('parsed', args.dtype, args.torch_compile)\n")
    result = run_script([str(probe)], cwd=tmp_path, launcher=[
        str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "1", "--num_machines", "1",
        "--cpu", *launch_flags], env={"HF_HOME": str(tmp_path / "hf")})  # no saved accelerate config of the user's
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"parsed {dtype} {compiled}" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("variables,flags,dtype", [
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, ["--bf16"], "bfloat16"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, ["--dtype", "bfloat16"], "bfloat16"),
    ({"ACCELERATE_MIXED_PRECISION": "no"}, ["--dtype", "float32"], "float32"),
    ({"ACCELERATE_MIXED_PRECISION": "", "ACCELERATE_DYNAMO_BACKEND": ""}, [], "auto"),
], ids=["bf16 and --bf16", "bf16 and --dtype bfloat16", "no and --dtype float32", "empty"])
def test_accelerate_precision_that_agrees_with_the_flags_is_accepted(monkeypatch, variables, flags, dtype):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    args = parse_args("train.py", flags)
    assert (args.dtype, args.torch_compile) == (dtype, False)


def test_two_nodes_recipe_meets_through_c10d(runs):
    """Two 'nodes' of one process each on this machine, started apart as on a cluster."""
    root, data = runs
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", **RECIPE_ENV, "NPROC": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RUN_ID": "test",
           "OUTPUT_DIR": str(root / "recipe-two-nodes")}
    nodes = [subprocess.Popen(["bash", str(RECIPES / "two_nodes.sh"), *data], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert_same_run(root / "recipe-two-nodes", root / "single")


def test_slurm_recipe_under_a_stand_in_srun(runs, tmp_path):
    """`srun` replaced by a script that starts the job step's tasks (one per node) on this machine."""
    root, data = runs
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\npids=()\n'
        'for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & '
        'pids+=($!); done\nstatus=0\nfor pid in "${pids[@]}"; do wait "$pid" || status=$?; done\nexit $status\n')
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{RECIPE_ENV['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_SUBMIT_DIR": str(REPO), "NPROC": "1",
           "MASTER_PORT": str(free_port()), "OUTPUT_DIR": str(root / "recipe-slurm")}
    result = run_script([str(RECIPES / "slurm.sbatch"), *data], launcher=["bash"], env={**RECIPE_ENV, **env},
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(root / "recipe-slurm", root / "single")


def test_elastic_recipe_recovers_a_killed_rank(tiny_model, tiny_data, tmp_path, reference):
    """examples/launch/elastic.sh as a user runs it, with rank 1 killed in step 6 (tests/fault_hook injects the
    fault into the workers that the recipe's torchrun starts): the job ends 0 with the uninterrupted run's model."""
    result = run_script([str(RECIPES / "elastic.sh"), *flags(tiny_model, tiny_data, tmp_path, *DDP)],
                        launcher=["bash"],
                        env={**RECIPE_ENV, "NPROC": "2", "MAX_RESTARTS": "1", "FAULT": "kill", "FAULT_STEP": "6",
                             "FAULT_RANK": "1", "PYTHONPATH": str(REPO / "tests" / "fault_hook")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "failed (exitcode: -9)" in result.stderr  # the kill happened, and torchrun saw it
    assert_same_run(tmp_path, reference / "ddp", exact=True)


def test_cpu_smoke_recipe_with_shared_interventions_in_file_order(tiny_model, tiny_data, tmp_path):
    """The smoke recipe, on paths no other run takes: one intervention per layer shared by its first and last
    positions, and batches in the data's order (no length grouping). One and two processes train the same model."""
    result = recipe("cpu_smoke.sh", ["--layers", "1;3", "--share_weights", "--group_by_length", "false",
                                     "--logging_steps", "1"],
                    {"MODEL": str(tiny_model), "DATA": str(tiny_data), "OUTPUT_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    args = json.loads((tmp_path / "two-processes" / "training_args.json").read_text())
    assert (args["share_weights"], args["group_by_length"]) == (True, False)
    weights = intervention_weights(tmp_path / "one-process")
    assert len({name.split("/")[0] for name in weights}) == 2  # one per layer, not per layer and side
    assert_same_run(tmp_path / "two-processes", tmp_path / "one-process")
    assert "one-process" in result.stdout and "two-processes" in result.stdout  # the answers, side by side
