"""--plan under --deepspeed: DeepSpeed's engine needs real tensors, so the plan (alpaca.plan) runs the step of a
torch strategy that places the base alike, and counts ZeRO's model states by DeepSpeed's layout
(alpaca.zero.planned_base_bytes and the functions beside it)."""

from __future__ import annotations

from alpaca import zero
from alpaca.model import intervention_parameters
from alpaca.strategy import DDP, FSDP, Strategy, ZeRO


def stand_in(strategy: ZeRO) -> Strategy:
    """Return the strategy whose step a ZeRO plan runs on the fake GPUs, DeepSpeed's engine needing real tensors: DDP
    for ZeRO-1/2 (the same replicated base and forward), --fsdp for ZeRO-3 (a base sharded, gathered as it runs; its
    shards in CPU memory with offload_param). `zero_parts` then counts the model states as ZeRO holds them."""
    if strategy.shards_base:
        return FSDP(strategy.device, strategy.max_grad_norm, offload=strategy.offload)
    return DDP(strategy.device, strategy.max_grad_norm, quantization=strategy.quantization)


def zero_parts(planned: dict[str, int], strategy: ZeRO, reft_model, world_size: int) -> dict[str, int]:
    """Count the parts of a ZeRO plan: the activations of the stand-in's step (`stand_in`, planned as `memory_parts`
    splits it), the model states by DeepSpeed's layout and the strategy's config, its model-sized values filled
    (alpaca.zero.planned_base_bytes, planned_trainable_bytes). Under ZeRO-3 the communication buffers keep the
    stand-in's gathered decoder layer and its all-gather buffer (FSDP gathers a layer where DeepSpeed gathers a
    module, so at least as much), plus the prefetcher's bucket and the module DeepSpeed keeps gathered for its
    backward, which FSDP gathers again."""
    trainable = [parameter for _, parameter in intervention_parameters(reft_model)]
    states, buckets = zero.planned_trainable_bytes(strategy.config, trainable, world_size)
    base, gathered = planned["base"], 0
    if strategy.shards_base:
        buffers = sum(buffer.nbytes for buffer in reft_model.model.buffers() if buffer.device.type == "cuda")
        base = buffers + zero.planned_base_bytes(strategy.config, list(reft_model.model.parameters()), world_size)
        gathered = (planned["communication"] + zero.planned_prefetch_bytes(strategy.config, reft_model.model.dtype)
                    + zero.planned_reused_bytes(reft_model.model, strategy.config))
    parts = {"base": base, "interventions": states, "communication": buckets + gathered,
             "activations": planned["activations"]}
    return {**parts, "total": sum(parts.values())}
