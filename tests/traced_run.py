"""Run train.py or train_multigpu.py on real tensors with the plan's memory tracker (alpaca.plan.memory_tracker)
around its first PLANNED_STEPS optimizer steps, as the plan runs them on fake ones:

    python tests/traced_run.py train.py <flags>        # or under torchrun, train_multigpu.py

Each rank prints `traced peak of rank <r>: <bytes> bytes` on stdout once those steps are done: what the tracker
saw on the training device, from the strategy's wrap to the end of the last traced step, and what the plan adds
to it that the tracker does not follow (alpaca.plan.untraced_bytes; under ZeRO-3 the parameters' partitions).
"""

import contextlib
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`
import torch.distributed as dist  # noqa: E402

import alpaca.strategy  # noqa: E402
from alpaca.model import intervention_parameters  # noqa: E402
from alpaca.plan import PLANNED_STEPS, memory_tracker, one_forward_at_a_time, untraced_bytes  # noqa: E402


def zero_partitions(reft_model) -> int:
    """Count ZeRO-3's partitions of the parameters (`ds_tensor`), which the tracker misses: it follows a partitioned
    parameter's empty placeholder."""
    parameters = [*reft_model.model.parameters(), *(p for _, p in intervention_parameters(reft_model))]
    return sum(p.ds_tensor.nbytes for p in parameters if hasattr(p, "ds_tensor"))


def traced(strategy):
    """Make `strategy` trace its first PLANNED_STEPS steps from its wrap on."""
    wrap = strategy.wrap

    def traced_wrap(reft_model, optimizer, scheduler, optimizer_state):
        train_model = wrap(reft_model, optimizer, scheduler, optimizer_state)
        tracker = memory_tracker(strategy, reft_model, optimizer)
        tracking = contextlib.ExitStack()
        tracking.enter_context(one_forward_at_a_time(tracker, train_model))
        tracking.enter_context(tracker)
        step = strategy.step

        def traced_step(number: int):
            grad_norm = step(number)
            if number == PLANNED_STEPS:
                tracking.close()
                peak = (tracker.get_tracker_snapshot("peak")[strategy.device]["Total"]
                        + untraced_bytes(strategy, reft_model, strategy.device) + zero_partitions(reft_model))
                rank = dist.get_rank() if dist.is_initialized() else 0
                print(f"traced peak of rank {rank}: {peak} bytes", flush=True)
            return grad_norm

        strategy.step = traced_step
        return train_model

    strategy.wrap = traced_wrap
    return strategy


choose_strategy = alpaca.strategy.choose_strategy
alpaca.strategy.choose_strategy = lambda *args, **kwargs: traced(choose_strategy(*args, **kwargs))

if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
