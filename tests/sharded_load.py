"""Under torchrun: build each MODEL_DIR's model on the meta device, shard it with --fsdp's functions and load
each rank's shards, and partition it with ZeRO-3's (alpaca.zero.partition_base); then check both against
the model transformers loads whole, in one process.

    torchrun --nproc_per_node N tests/sharded_load.py MODEL_DIR [MODEL_DIR ...]

Under --fsdp also a 4-bit (NF4, double-quantized) base against the model transformers quantizes whole: the
gathered packed bytes, each layer's quantization constants and the logits.

Checks: every parameter (gathered) and buffer equals the whole model's, tied parameters are still one
parameter, nothing is left on the meta device, and the sharded (gathered) forward gives the whole model's
logits. Under ZeRO-3, each parameter is this rank's partition alone once loaded, and the rank has read from
the files no more than its partitions (and the parts of rows around them): never a whole tensor that it does
not own. Prints "ok" on rank 0, for each model and strategy.
"""

import datetime
import gc
import math
import os
import sys
from pathlib import Path

import read_count  # before transformers imports safetensors' reader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from alpaca.distributed import let_go_of_process_group  # noqa: E402
from alpaca.model import build_reft_model, quantization_config  # noqa: E402
from alpaca.sharding import empty_base_model, load_shards, quantize_empty_base  # noqa: E402
from alpaca.strategy import shard_base_model  # noqa: E402
from alpaca.workarounds import keep_4bit_layers_differentiable  # noqa: E402
from alpaca.zero import partition_base, start  # noqa: E402

cpu = torch.device("cpu")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
try:
    for model_dir in sys.argv[1:]:
        whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        sharded = empty_base_model(model_dir, torch.float32)
        assert all(p.is_meta for p in sharded.parameters())
        build_reft_model(sharded, "1", (1, 1), False, low_rank_dimension=2)  # as in train_multigpu.py: before sharding
        shard_base_model(sharded, cpu)
        load_shards(sharded, model_dir, cpu)

        tied = whole.config.tie_word_embeddings
        assert (sharded.lm_head.weight is sharded.get_input_embeddings().weight) == tied, "tying changed"
        assert not any(t.is_meta for t in [*sharded.parameters(), *sharded.buffers()]), "left on meta"
        uneven = False
        for name, expected in whole.named_parameters():
            actual = sharded.get_parameter(name)
            assert isinstance(actual, DTensor), name
            uneven |= actual.shape[0] % dist.get_world_size() != 0
            torch.testing.assert_close(actual.full_tensor(), expected, rtol=0, atol=0, msg=name)
        for name, expected in whole.named_buffers():
            torch.testing.assert_close(sharded.get_buffer(name), expected, rtol=0, atol=0, msg=name)
        assert uneven, "the test model should have a tensor that splits unevenly"
        ids = torch.arange(24).reshape(2, 12) % whole.config.vocab_size
        # and no unit runs beside the previous unit's all-gather buffer (alpaca.strategy.drop_deferred_all_gather)
        units = [module for module in sharded.modules() if isinstance(module, FSDPModule)]
        held = []
        for unit in units:
            unit.register_forward_pre_hook(
                lambda *_, held=held, root=sharded: held.append(root._get_fsdp_state()._comm_ctx.all_gather_state))
        with torch.no_grad():
            torch.testing.assert_close(sharded(input_ids=ids).logits, whole(input_ids=ids).logits, rtol=0, atol=0)
        assert held == [None] * len(units), f"{sum(state is not None for state in held)} units ran beside a buffer"
        if int(os.environ["RANK"]) == 0:
            print(f"ok: {dist.get_world_size()} ranks, tied={tied}")

        # --fsdp --load_in_4bit: the gathered packed bytes and each layer's quantization constants are those of
        # the model transformers quantizes whole; so are the logits
        nf4 = quantization_config({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                   "bnb_4bit_use_double_quant": True}, torch.float32)
        whole_4bit = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=nf4,
                                                          device_map={"": cpu})
        sharded_4bit = empty_base_model(model_dir, torch.float32)
        quantize_empty_base(sharded_4bit, nf4)
        for model in (whole_4bit, sharded_4bit):
            keep_4bit_layers_differentiable(model)  # the same kernel in both
        build_reft_model(sharded_4bit, "1", (1, 1), False, low_rank_dimension=2)
        shard_base_model(sharded_4bit, cpu)
        load_shards(sharded_4bit, model_dir, cpu)
        quantized = 0
        for name, expected in whole_4bit.named_parameters():
            torch.testing.assert_close(sharded_4bit.get_parameter(name).full_tensor(), expected.data, rtol=0, atol=0,
                                       msg=name)
            if hasattr(expected, "quant_state"):
                quantized += 1
                constants = sharded_4bit.get_submodule(name.removesuffix(".weight")).quant_state.as_dict(packed=True)
                for key, value in expected.quant_state.as_dict(packed=True).items():
                    torch.testing.assert_close(constants[key], value, rtol=0, atol=0, msg=f"{name} {key}")
        assert quantized == 7 * whole.config.num_hidden_layers, quantized
        with torch.no_grad():
            torch.testing.assert_close(sharded_4bit(input_ids=ids).logits, whole_4bit(input_ids=ids).logits, rtol=0,
                                       atol=0)
        if int(os.environ["RANK"]) == 0:
            print(f"ok: 4-bit, {dist.get_world_size()} ranks, tied={tied}")

        # ZeRO-3: the persistence threshold at its "auto" value (10 x hidden): the norms stay whole in training,
        # and are partitioned at load like the rest.
        world = dist.get_world_size()
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}}
        partitioned = empty_base_model(model_dir, torch.float32, reader="ZeRO-3")
        build_reft_model(partitioned, "1", (1, 1), False, low_rank_dimension=2)
        start(config, partitioned, cpu, datetime.timedelta(minutes=5), trainable_elements=1)
        read_before = read_count.bytes_read()
        partition_base(partitioned, model_dir, config, cpu)
        read = read_count.bytes_read() - read_before
        assert (partitioned.lm_head.weight is partitioned.get_input_embeddings().weight) == tied, "tying changed"
        assert not any(t.is_meta for t in [*partitioned.parameters(), *partitioned.buffers()]), "left on meta"
        owned = 0  # bytes of this rank's partitions, plus the rest of the rows they start and end in
        for name, expected in whole.named_parameters():
            actual = partitioned.get_parameter(name)
            partition_numel = math.ceil(expected.numel() / world)
            assert actual.numel() == 0 and actual.ds_tensor.numel() == partition_numel, name
            row = expected[0].numel() if expected.dim() else 1
            owned += (partition_numel + 2 * row) * expected.element_size()
            with deepspeed.zero.GatheredParameters([actual]):
                torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)
        assert read <= owned, f"rank {dist.get_rank()} read {read} bytes, its partitions {owned}"
        for name, expected in whole.named_buffers():
            torch.testing.assert_close(partitioned.get_buffer(name), expected, rtol=0, atol=0, msg=name)
        with deepspeed.zero.GatheredParameters(list(partitioned.parameters())), torch.no_grad():
            torch.testing.assert_close(partitioned(input_ids=ids).logits, whole(input_ids=ids).logits, rtol=0,
                                       atol=0)
        if int(os.environ["RANK"]) == 0:
            print(f"ok: ZeRO-3, {world} ranks, tied={tied}")
finally:  # what holds the group lets go of it, then it is destroyed
    let_go_of_process_group()
    dist.destroy_process_group()
    gc.collect()
