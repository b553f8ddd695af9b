"""A bitsandbytes-quantized frozen base (QReFT: --load_in_4bit, --load_in_8bit). On the same 4-bit base one process,
two DDP ranks (with --gradient_checkpointing), two ZeRO-2 ranks and two and four --fsdp ranks (the 4-bit base sharded)
train the same model; an 8-bit base trains packed under a device map; a resume is bit-identical and bound to the
quantization; the output loads onto the quantized and the full-precision base (ours, examples/generate.py, pyreft's
loader); what cannot combine with a quantized base is refused in one line before any weight loads."""

import json

import pytest
import torch
from conftest import (
    REPO,
    assert_same_run,
    copy_as_killed,
    disk_map,
    flags,
    intervention_weights,
    one_thread,
    run_in_process,
    torchrun,
)

from alpaca.model import load_base_model
from alpaca.strategy import local_parameter_bytes

NF4 = ["--load_in_4bit", "--dropout", "0"]  # FLAGS' dropout off: its streams differ between 1 and 2 processes
SHARDED_ON_TWO = ["--fsdp", "--gradient_accumulation_steps", "2", "--gradient_checkpointing", "--num_sample_answers",
                  "2", "--max_new_tokens", "4"]


@pytest.fixture(scope="session")
def qreft_runs(tiny_model, tiny_data, tmp_path_factory):
    """On the tiny model's NF4 base, global batch 8 (FLAGS: 9 steps, checkpoints every 2, evaluation): one process
    (x 4 accumulation, one thread as torchrun's workers), two DDP ranks (x 2) with --gradient_checkpointing,
    and two ZeRO-2 ranks (x 2)."""
    root = tmp_path_factory.mktemp("qreft")
    with one_thread():
        status, stdout, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, root / "single", *NF4,
                                                                  "--gradient_accumulation_steps", "4"))
    assert status == 0, stderr[-3000:]
    assert "(4-bit nf4, computing in torch.float32)" in stdout
    for name, extra in (("ddp", ["--gradient_checkpointing"]),
                        ("zero2", ["--deepspeed", str(REPO / "examples" / "deepspeed" / "zero2.json")])):
        result = torchrun(2, ["train_multigpu.py", *flags(tiny_model, tiny_data, root / name, *NF4,
                                                          "--gradient_accumulation_steps", "2", *extra)])
        assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.fixture(scope="session")
def sharded_qreft_runs(qreft_runs, tiny_model, tiny_data):
    """`qreft_runs`' NF4 base sharded by --fsdp: on two ranks (x 2) with --gradient_checkpointing, ending with
    sample answers, and on four (x 1) with --packing. Returns the launches' results by process count."""
    results = {}
    for nproc, extra in ((2, SHARDED_ON_TWO), (4, ["--fsdp", "--gradient_accumulation_steps", "1", "--packing"])):
        results[nproc] = torchrun(nproc, ["train_multigpu.py", *flags(tiny_model, tiny_data,
                                                                      qreft_runs / f"fsdp{nproc}", *NF4, *extra)])
        assert results[nproc].returncode == 0, results[nproc].stderr[-3000:]
    return results


def test_fsdp_on_a_4bit_base_trains_the_model_of_one_process_and_of_ddp(qreft_runs, sharded_qreft_runs):
    """Each rank quantizes each weight whole, as transformers does on one process, and keeps its rows: 2 and 4
    ranks train one process's model on the same 4-bit base (the suite's tolerance; 4 packed), 2 ranks DDP's bit for
    bit (the same sums over the same ranks); evaluation and sample answers run on the sharded base."""
    assert_same_run(qreft_runs / "fsdp2", qreft_runs / "single")
    assert_same_run(qreft_runs / "fsdp4", qreft_runs / "single")
    assert_same_run(qreft_runs / "fsdp2", qreft_runs / "ddp", exact=True)
    stdout = sharded_qreft_runs[2].stdout
    assert "(4-bit nf4, computing in torch.float32)" in stdout and "sharded (FSDP)" in stdout
    assert stdout.count("Instruction: ") == 2 and "REFT MODEL" in stdout


def test_fsdp_holds_a_shrinking_share_of_the_4bit_base_per_rank(qreft_runs, sharded_qreft_runs):
    """Per rank, the 4-bit base's bytes (its rows of each packed weight, the unquantized tensors' rows, and every
    quantized weight's constants, which bitsandbytes keeps whole): at most 0.6 of DDP's whole 4-bit copy on two
    ranks, 0.35 on four."""
    def base_bytes(name):
        return json.loads((qreft_runs / name / "training_args.json").read_text())["base_parameter_bytes_per_rank"]

    assert base_bytes("fsdp2") <= 0.6 * base_bytes("ddp") and base_bytes("fsdp4") <= 0.35 * base_bytes("ddp")


def test_a_resume_of_fsdp_on_a_4bit_base_is_bit_identical_and_its_output_answers(qreft_runs, sharded_qreft_runs,
                                                                                tiny_model, tiny_data, tmp_path):
    """From checkpoint-4 of the two-rank run, the same launch: the uninterrupted run bit for bit. Its output
    answers through examples/generate.py on the 4-bit base."""
    resumed = copy_as_killed(qreft_runs / "fsdp2", tmp_path / "resumed", last_checkpoint=4)
    result = torchrun(2, ["train_multigpu.py", *flags(tiny_model, tiny_data, resumed, *NF4, *SHARDED_ON_TWO,
                                                      "--resume_from_checkpoint", "auto")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 4" in result.stdout
    assert_same_run(resumed, qreft_runs / "fsdp2", exact=True)
    status, stdout, stderr = run_in_process("examples/generate.py", ["--reft_dir", resumed, "--instruction",
                                                                     "Name three primary colors.",
                                                                     "--max_new_tokens", "4", "--load_in_4bit"])
    assert status == 0, stderr[-3000:]
    assert "REFT MODEL" in stdout


def test_one_process_ddp_and_zero2_train_the_same_model_on_a_4bit_base(qreft_runs):
    assert_same_run(qreft_runs / "ddp", qreft_runs / "single")
    assert_same_run(qreft_runs / "zero2", qreft_runs / "single")


def test_a_resume_on_a_4bit_base_is_bit_identical_and_bound_to_the_quantization(qreft_runs, tiny_model, tiny_data,
                                                                              tmp_path):
    """From checkpoint-4 with the original flags: the uninterrupted run bit for bit. With the base quantized
    otherwise (8-bit, fp4, or not at all): refused in one line, naming each difference."""
    resumed = copy_as_killed(qreft_runs / "single", tmp_path / "resumed", last_checkpoint=4)
    single = flags(tiny_model, tiny_data, resumed, "--dropout", "0", "--gradient_accumulation_steps", "4",
                   "--resume_from_checkpoint", "auto")
    for other, difference in ((["--load_in_8bit"], "--load_in_4bit (True in the checkpoint, False in this run); "
                                                    "--load_in_8bit (False in the checkpoint, True in this run)"),
                              (["--load_in_4bit", "--bnb_4bit_quant_type", "fp4"],
                               "--bnb_4bit_quant_type (nf4 in the checkpoint, fp4 in this run)"),
                              ([], "--load_in_4bit (True in the checkpoint, False in this run)")):
        status, _, stderr = run_in_process("train.py", [*single, *other])
        assert status == 2, stderr[-3000:]
        lines = [line for line in stderr.splitlines() if line.startswith("train.py: error:")]
        assert len(lines) == 1 and f"this run differs from the checkpoint in {difference}" in lines[0], stderr
    with one_thread():
        status, stdout, stderr = run_in_process("train.py", [*single, "--load_in_4bit"])
    assert status == 0, stderr[-3000:]
    assert "at step 4" in stdout
    assert_same_run(resumed, qreft_runs / "single", exact=True)


def test_a_checkpoint_that_records_no_quantization_is_refused(qreft_runs, tiny_model, tiny_data,
                                                                              tmp_path):
    """A checkpoint whose flags lack the quantization ones cannot say what base it was trained on: its resume is
    refused in one line naming them. (The NF4 run's checkpoint, its quantization flags stripped and its manifest
    updated to match.)"""
    from alpaca.manifest import MANIFEST, sha256

    copy_as_killed(qreft_runs / "single", tmp_path, last_checkpoint=4)
    state_file, manifest_file = tmp_path / "checkpoint-4" / "trainer_state.json", tmp_path / "checkpoint-4" / MANIFEST
    state = json.loads(state_file.read_text())
    for name in ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant"):
        del state["fingerprint"]["flags"][name]
    state_file.write_text(json.dumps(state))
    manifest = json.loads(manifest_file.read_text())
    manifest["files"]["trainer_state.json"] = {"bytes": state_file.stat().st_size, "sha256": sha256(state_file)}
    manifest_file.write_text(json.dumps(manifest))
    status, _, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, tmp_path, *NF4,
                                                         "--gradient_accumulation_steps", "4",
                                                         "--resume_from_checkpoint", "auto"))
    assert status == 2
    assert ("this run differs from the checkpoint in --load_in_4bit (not recorded in the checkpoint, True in this "
            "run); --load_in_8bit (not recorded in the checkpoint, False in this run)") in stderr


def test_the_output_loads_onto_the_quantized_and_the_full_precision_base(qreft_runs, tiny_model):
    """The saved arguments name the quantization; examples/generate.py answers with the interventions on the 4-bit
    base and on the float32 one, and pyreft's own loader reads them onto either."""
    import pyreft

    run = qreft_runs / "single"
    saved = json.loads((run / "training_args.json").read_text())
    assert (saved["load_in_4bit"], saved["load_in_8bit"], saved["bnb_4bit_quant_type"],
            saved["bnb_4bit_use_double_quant"]) == (True, False, "nf4", False)
    for quantized in (["--load_in_4bit"], []):
        status, stdout, stderr = run_in_process("examples/generate.py", ["--reft_dir", run, "--instruction",
                                                                         "Name three primary colors.",
                                                                         "--max_new_tokens", "6", *quantized])
        assert status == 0, stderr[-3000:]
        assert "REFT MODEL" in stdout
    weights = intervention_weights(run)
    for quantization in ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, None):
        base, _ = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"), quantization=quantization)
        reft_model = pyreft.ReftModel.load(str(run), base)
        for key, intervention in reft_model.interventions.items():
            assert torch.equal(intervention.rotate_layer.weight, weights[f"intkey_{key}.bin/rotate_layer"])


def test_the_quantized_base_holds_its_linear_layers_in_4_or_8_bits(tiny_model):
    """bitsandbytes quantizes every decoder linear as transformers loads the base (not the LM head, nor the
    embeddings): 4-bit weights take half a byte and a float32 scale per 64 values (with double quantization a
    one-byte scale, itself scaled per 256 blocks); 8-bit ones a byte and a scale per row. What benchmarks/memory.py
    reports per rank."""
    import bitsandbytes as bnb

    def linear_bytes_per_parameter(quantization, kind, scale_dtype=None):
        model, _ = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"), quantization=quantization)
        linears = [module for name, module in model.named_modules() if ".layers." in name
                   and isinstance(module, torch.nn.Linear)]
        assert linears and all(isinstance(module, kind) for module in linears)
        assert not isinstance(model.lm_head, kind)
        if scale_dtype is not None:
            assert all(module.weight.quant_state.absmax.dtype == scale_dtype for module in linears)
        held = sum(local_parameter_bytes(module) for module in linears)
        return held / sum(module.in_features * module.out_features for module in linears)

    nf4 = linear_bytes_per_parameter({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, bnb.nn.Linear4bit,
                                     torch.float32)
    double = linear_bytes_per_parameter({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4",
                                         "bnb_4bit_use_double_quant": True}, bnb.nn.Linear4bit, torch.uint8)
    int8 = linear_bytes_per_parameter({"load_in_8bit": True}, bnb.nn.Linear8bitLt)
    assert 0.5 + 4 / 64 <= nf4 < 0.6 and 0.5 + 1 / 64 < double < 1  # the tiny layers' fixed overheads weigh in
    assert 1 < int8 < 1.1


def test_an_8bit_base_trains_packed_under_a_device_map(tiny_model, tiny_data, tmp_path):
    """--load_in_8bit with a JSON --device_map (every module on the CPU, here) and --packing: the loss goes down."""
    cpu_map = json.dumps(dict.fromkeys(json.loads(disk_map()), "cpu"))
    status, stdout, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, tmp_path, "--load_in_8bit",
                                                              "--device_map", cpu_map, "--max_steps", "6",
                                                              "--save_strategy", "no", "--packing"))
    assert status == 0, stderr[-3000:]
    assert "(8-bit, computing in torch.float32) on --device_map (cpu:" in stdout
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0]


def refused(script: str, argv: list, message: str) -> None:
    status, stdout, stderr = run_in_process(script, argv)
    assert status == 2 and not stdout
    assert stderr.strip().splitlines() == [f"{script.rsplit('/', 1)[-1]}: error: {message}"]


@pytest.mark.parametrize("extra, message", [
    (["--load_in_4bit", "--load_in_8bit"], "--load_in_4bit and --load_in_8bit are exclusive; pick one"),
    (["--bnb_4bit_quant_type", "fp4"],
     "--bnb_4bit_quant_type sets how --load_in_4bit quantizes the base; add --load_in_4bit, or drop it"),
    (["--load_in_8bit", "--bnb_4bit_use_double_quant"],
     "--bnb_4bit_use_double_quant sets how --load_in_4bit quantizes the base; add --load_in_4bit, or drop it"),
    (["--load_in_8bit", "--fsdp"],
     "--load_in_8bit and --fsdp do not combine: bitsandbytes keeps an 8-bit weight's row scales on the weight, "
     "which FSDP2's gathered weight loses; use --load_in_4bit with --fsdp, or DDP (docs/big-models.md)"),
    (["--load_in_4bit", "--fsdp", "full_shard offload"],
     "--load_in_4bit with --fsdp offload: the shards would sit in CPU memory and their quantization constants with "
     "them, not on the GPU that computes; drop 'offload' (docs/big-models.md)"),
    (["--load_in_8bit", "--deepspeed", "examples/deepspeed/zero3.json"],
     "--load_in_8bit and ZeRO-3 do not combine: these scripts shard a quantized base under --fsdp only; use --fsdp "
     "with --load_in_4bit, ZeRO-1/2 (examples/deepspeed/zero2.json) or DDP (docs/big-models.md)"),
    (["--load_in_4bit", "--device_map", disk_map(), "--offload_folder", "offload"],
     "--load_in_4bit with --device_map: bitsandbytes cannot offload quantized layers to disk; place every module "
     "on a GPU or the CPU and drop --offload_folder (docs/big-models.md)"),
    (["--load_in_4bit", "--dtype", "float64"],
     "--load_in_4bit computes in float32, bfloat16 or float16, not float64; pick one of those with --dtype, or drop "
     "the quantization"),
    (["--load_in_4bit", "--torch_compile"],
     "--torch_compile is not yet tested with --load_in_4bit (bitsandbytes' kernels); drop one of them"),
])
def test_what_a_quantized_base_does_not_combine_with_is_refused_in_one_line(extra, message, tmp_path):
    """Before anything loads (the model does not even exist)."""
    refused("train_multigpu.py", ["--model_name_or_path", tmp_path / "none", "--output_dir", tmp_path, *extra],
            message)


def test_generate_refuses_a_quantized_base_on_disk_in_one_line(tmp_path):
    refused("examples/generate.py", ["--reft_dir", tmp_path, "--load_in_8bit", "--device_map", "auto",
                                     "--offload_folder", tmp_path],
            "--load_in_8bit with --device_map: bitsandbytes cannot offload quantized layers to disk; place every "
            "module on a GPU or the CPU and drop --offload_folder (docs/big-models.md)")



def test_a_forward_without_gradient_leaves_the_4bit_layers_differentiable(tiny_model):
    """An evaluation (eval mode, no gradient) between two training steps: the interventions' gradients through the
    4-bit layers above them are the same after it as before (bitsandbytes would otherwise switch those layers, on
    CPUs with AVX512-BF16, to a kernel without a backward: alpaca.workarounds.keep_4bit_layers_differentiable)."""
    from alpaca.model import build_reft_model

    model, _ = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"),
                               quantization={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"})
    torch.manual_seed(0)
    reft_model = build_reft_model(model, "1", (1, 1), False, low_rank_dimension=4)
    ids = torch.randint(0, 300, (2, 12))
    locations = {"sources->base": (None, [[[0], [0]], [[11], [11]]])}

    def gradients():
        reft_model.interventions.zero_grad()
        _, outputs = reft_model({"input_ids": ids}, unit_locations=locations)
        outputs.logits.logsumexp(-1).sum().backward()
        return [parameter.grad.clone() for parameter in reft_model.interventions.parameters()]

    before = gradients()
    with torch.no_grad():
        reft_model({"input_ids": ids}, unit_locations=locations)
    assert all(torch.equal(a, b) for a, b in zip(gradients(), before, strict=True)) and before
