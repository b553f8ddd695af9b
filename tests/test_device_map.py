"""--device_map: with one device type a device map changes no arithmetic. On CPU, decoder layers offloaded to disk
(layer 2 intervened, layer 0 not) train bit-identically the plain run's weights, losses and grad norms, on one
process and on two DDP ranks (that one in tests/test_recipes.py, through examples/launch/device_map.sh); their
weights really are off memory (on the meta device) between forwards; and so with --gradient_checkpointing, whose
recomputation of an offloaded layer brings its weights from disk again."""


import pytest
import torch
from conftest import (
    OFFLOADED,
    SINGLE,
    assert_same_run,
    copy_as_killed,
    disk_map,
    flags,
    loss_and_gradients,
    run_in_process,
    torchrun,
    training_flags,
    with_faked_gpus,
    workers_output,
)

from alpaca.args import parse_args, resolve_device_defaults
from alpaca.layers import decoder_layers
from alpaca.strategy import choose_strategy


def test_layers_on_disk_train_the_plain_run_exactly_and_resume_exactly(reference, tiny_model, tiny_data, tmp_path):
    """Against the reference's one-process run (dropout, checkpoints, evaluation): the same run bit for bit, and
    so is its resume from checkpoint-4 with the layers on disk again, there with --gradient_checkpointing too
    (steps 5-9: layer 2, on disk, recomputed in each backward; checkpointing changes no arithmetic either)."""
    placed = ["--device_map", disk_map(), "--offload_folder", str(tmp_path / "offload")]
    status, stdout, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, tmp_path / "map", *SINGLE,
                                                               *placed))
    assert status == 0, stderr[-3000:]
    assert "on --device_map (cpu: 6 modules, disk: 2 modules)" in stdout
    assert_same_run(tmp_path / "map", reference / "single", exact=True)
    resumed = copy_as_killed(tmp_path / "map", tmp_path / "resumed", last_checkpoint=4)
    status, _, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, resumed, *SINGLE, *placed,
                                                         "--gradient_checkpointing", "--resume_from_checkpoint",
                                                         "auto"))
    assert status == 0, stderr[-3000:]
    assert_same_run(resumed, reference / "single", exact=True)


def test_layers_on_disk_wait_on_the_meta_device_between_forwards(tiny_model, tiny_data, tmp_path):
    """Loaded as train.py loads it: the offloaded layers' parameters are on the meta device (no memory) before a
    forward, after it and after the backward, the others in CPU memory; yet the loss and the interventions'
    gradients are the plain model's: the weights came from disk for the forward. With --gradient_checkpointing
    too: the layers backward goes through (2 and 3, above the lowest intervention) run again in the backward,
    layer 2's weights brought from disk again by accelerate's hook, and the gradients are still the plain ones."""
    import train

    def placed_loss_and_gradients(*placement: str):
        args = parse_args("train.py", training_flags(tiny_model, tiny_data, None, "--position", "f2+l2", *placement))
        resolve_device_defaults(args, "cpu")
        strategy = choose_strategy(args, torch.device("cpu"), torch.float32, [], distributed=False)
        loaded = train.load_data_and_model(args, strategy, torch.float32, torch.device("cpu"))
        reft_model, dataset, collate = loaded.reft_model, loaded.dataset, loaded.collate
        train_model = strategy.wrap(reft_model, None, None, None)
        layers = decoder_layers(reft_model.model)
        forwards = []
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda module, args, index=index: forwards.append(index))

        def devices() -> list[set[str]]:
            return [{parameter.device.type for parameter in layer.parameters()} for layer in layers]

        after_forward = []

        def forward_then_look(*inputs, **kwargs):
            outputs = train_model(*inputs, **kwargs)
            after_forward.append(devices())
            return outputs

        before = devices()
        batch = collate([dataset[i] for i in range(4)])
        loss, gradients = loss_and_gradients(reft_model, batch, forward_then_look)
        assert [before] == after_forward and before == devices()
        return loss, gradients, before, sorted(forwards)

    plain_loss, plain_gradients, plain_devices, plain_forwards = placed_loss_and_gradients()
    assert plain_devices == [{"cpu"}] * 4 and plain_forwards == [0, 1, 2, 3]
    on_disk = ["--device_map", disk_map(), "--offload_folder", str(tmp_path)]
    for checkpointing, forwards_expected in (([], [0, 1, 2, 3]), (["--gradient_checkpointing"], [0, 1, 2, 2, 3, 3])):
        loss, gradients, placed, forwards = placed_loss_and_gradients(*on_disk, *checkpointing)
        assert placed == [{"meta"} if index in OFFLOADED else {"cpu"} for index in range(4)]
        assert forwards == forwards_expected, checkpointing
        assert torch.equal(loss, plain_loss)
        assert all(torch.equal(a, b) for a, b in zip(gradients, plain_gradients, strict=True)) and gradients


@pytest.mark.fast
def test_device_map_with_fsdp_or_deepspeed_is_refused(tmp_path):
    for sharding in (["--fsdp"], ["--deepspeed", "examples/deepspeed/zero3.json"]):
        status, _, stderr = run_in_process("train_multigpu.py", ["--device_map", "auto", *sharding, "--output_dir",
                                                                 tmp_path])
        assert status == 2
        assert stderr.strip().splitlines() == [
            f"train_multigpu.py: error: --device_map and {sharding[0]} are exclusive: a device map places each "
            f"process's whole model, {sharding[0]} shards it across processes; pick one (docs/big-models.md)"]


def test_gpus_that_do_not_divide_among_the_processes(tiny_model, tmp_path):
    """3 GPUs (faked) for 2 processes with --device_map: one line says which process counts divide them."""
    result = torchrun(2, [*with_faked_gpus(3), "train_multigpu.py", "--model_name_or_path",
                          str(tiny_model), "--output_dir", str(tmp_path), "--device_map", "auto"],
                      extra=["--no-python"])
    assert result.returncode != 0
    message = ("train_multigpu.py: error: --device_map gives each process an equal group of the node's GPUs, but 3 "
               "GPUs do not divide among 2 processes; launch with --nproc_per_node one of 1, 3")
    assert workers_output(result.stderr).count(message) == 1, result.stderr[-3000:]


@pytest.mark.fast
def test_a_checkpoint_keeps_the_random_state_of_every_gpu_of_the_process(monkeypatch):
    """A device map runs interventions, and their dropout, on each GPU of the process: a checkpoint keeps every
    one's generator (the first under "cuda", as a one-GPU run has it), and a resume puts each back on its GPU.
    (CUDA's generators faked: no GPU here.)"""
    from alpaca.resume import restore_rng_state, rng_state

    generators = {2: torch.tensor([2], dtype=torch.uint8), 3: torch.tensor([3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda gpu: generators[gpu].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, gpu: generators.__setitem__(gpu, state.clone()))
    saved = rng_state([2, 3])
    assert torch.equal(saved["cuda"], torch.tensor([2], dtype=torch.uint8))
    generators.update({2: torch.tensor([7], dtype=torch.uint8), 3: torch.tensor([7], dtype=torch.uint8)})
    restore_rng_state(saved, [2, 3])
    assert generators[2].item() == 2 and generators[3].item() == 3
