"""Train LoReFT interventions on Alpaca instruction data on N processes: train.py's model.

    torchrun --nproc_per_node 8 train_multigpu.py <train.py flags>   # more: docs/multi-gpu.md
    python train_multigpu.py ...         # one process

Each rank takes its share of each of train.py's global batches, weighted by the label tokens of the
whole global batch: N processes compute one process's gradient and train the same model.
`diff train.py train_multigpu.py` shows what N processes add.
"""

import argparse
import sys

from alpaca.args import exit_on_usage_error, parse_args, resolve_device_defaults

PROG = "train_multigpu.py"

if __name__ == "__main__":  # --help and usage errors answer here, before the heavy imports below
    ARGS = parse_args(PROG, multigpu=True)

import datetime
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
from datasets import Dataset
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from alpaca.checkpoint import (
    TrainerState,
    load_checkpoint,
    prepare_output_dir,
    save_checkpoint,
    save_output,
)
from alpaca.collate import Collator, StepCollator, give_step_counts, step_counts
from alpaca.data import load_training_splits, tokenize_splits
from alpaca.device_map import local_rank_gpus
from alpaca.distributed import (
    bound_device,
    first_on_local_main,
    gather_rank_report,
    let_go_of_process_group,
    main_rank_result,
    run_checked,
    start_process_group,
)
from alpaca.divergence import exit_if_diverged
from alpaca.errors import UsageError
from alpaca.flag_values import parse_position
from alpaca.generation import sample_answers
from alpaca.launcher_env import launched_alone_as_world_of_one
from alpaca.loss import evaluate, summed_token_loss, token_weighted_loss
from alpaca.model import (
    build_reft_model,
    check_attention,
    check_model,
    compile_decoder_layers,
    describe,
    enable_gradient_checkpointing,
    num_intervened_layers,
    resolve_dtype,
    set_attention,
)
from alpaca.optim import build_optimizer
from alpaca.output import (
    LogWindow,
    MetricsLog,
    eval_record,
    quiet_non_main_rank,
    start_line,
    train_record,
)
from alpaca.plan import plan
from alpaca.resume import (
    TrainingStart,
    check_finished,
    finished_record,
    geometry,
    restore_training_state,
    rng_state,
    training_fingerprint,
)
from alpaca.sampler import DistributedGlobalBatchSampler, dataloader_worker_init, eval_batches
from alpaca.signals import StopSignal
from alpaca.step_schedule import StepSchedule
from alpaca.strategy import choose_strategy, local_parameter_bytes


@record  # an error's traceback is the root cause in torchrun's summary (a one-line error: its line)
def main(args: argparse.Namespace) -> None:
    """Set up the device and train on it; a mistake found after parsing ends the run with one line
    and exit status 2."""
    try:
        if args.plan is not None:  # two steps on fake GPUs: peak memory and a verdict (alpaca.plan)
            return plan(PROG, args, backward_step)
        started = time.perf_counter()
        launched_alone_as_world_of_one()  # plain `python`: torchrun's environment for one process
        device, gpus = choose_device(args)
        resolve_device_defaults(args, device.type)
        dtype = resolve_dtype(args.dtype, device)
        check_attention(args.attn_implementation, device, dtype)
        backend = args.ddp_backend or ("nccl" if device.type == "cuda" else "gloo")
        start_process_group(backend, args.ddp_timeout, device_id=bound_device(gpus))
        try:
            if dist.get_rank() != 0:  # other ranks print errors only
                quiet_non_main_rank()
            train(args, device, dtype, gpus, started)
        finally:  # however training ends: what holds the group lets go of it, then it is destroyed
            let_go_of_process_group()
            dist.destroy_process_group()
            gc.collect()  # FSDP's sharded modules, collectable once the group is gone
    except UsageError as error:
        exit_on_usage_error(PROG, error)


def choose_device(args: argparse.Namespace) -> tuple[torch.device, list[int]]:
    """Pick this process's device and its GPUs, the batch entering on the first; the CPU where
    there is none."""
    if not torch.cuda.is_available():
        return torch.device("cpu"), []
    gpus = local_rank_gpus(PROG, device_map=args.device_map is not None)
    device = torch.device("cuda", gpus[0])
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    return device, gpus


def train(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, gpus: list[int],
          started: float) -> None:
    """Load the data and the model, train, and write the output."""
    world_size, is_main = dist.get_world_size(), dist.get_rank() == 0
    stop = StopSignal()  # SIGTERM (preemption, forwarded by torchrun) or SIGINT: checkpoint, exit
    strategy = choose_strategy(args, device, dtype, gpus)  # how the model is placed and stepped
    # an earlier run is refused before anything loads; rank 0 owns the output directory
    resume_from, finished = main_rank_result(lambda: prepare_output_dir(args), device)
    if finished is not None:  # a requeue of a finished run, decided before the base model loads
        print(main_rank_result(lambda: check_finished(finished, args, world_size, dtype), device))
        return

    # -- data and model ------------------------------------------------------------------------
    loaded = load_data_and_model(args, strategy, dtype, device)
    reft_model, dataset = loaded.reft_model, loaded.dataset

    # -- optimization: global batch = per_device x world_size x accumulation -------------------
    schedule = StepSchedule.from_args(args, len(dataset), world_size)
    optimizer, scheduler = build_optimizer(reft_model, args, schedule)
    summary = describe(reft_model, len(dataset), device)  # on rank 0; each rank's: `placement`
    start, train_model = training_start(args, loaded, strategy, optimizer, scheduler, gpus=gpus,
                                        resume_from=resume_from)
    base_bytes = local_parameter_bytes(reft_model.model)  # the base parameters this rank holds
    resolved = dict(world_size=world_size, global_batch_size=schedule.global_batch_size,
                    total_steps=schedule.total_steps, base_parameter_bytes_per_rank=base_bytes)
    placement = (f" | {dist.get_backend()} | base model {strategy.layout}: "
                 f"{base_bytes / 2**20:.1f} MiB of parameters on rank 0")
    ready_s = time.perf_counter() - started
    print(start_line(summary, schedule, args, eval_size=len(loaded.eval_dataset or []),
                     resume_from=resume_from, step=start.step, ready_s=ready_s,
                     processes=world_size, placement=placement), flush=True)  # rank 0's stdout
    metrics = MetricsLog(args.output_dir, args, resume_step=start.step,
                         wandb_run_id=start.wandb_run_id, held_out=loaded.held_out,
                         disable=not is_main, **resolved)
    window = LogWindow(device, start.window)
    step, epoch, eval_time = start.step, start.epoch, 0.0

    def checkpoint(epoch: int, next_batch: int) -> Path:
        """Save the state after `step` optimizer steps, to go on at (epoch, next_batch) of the
        global batch plan; if writing fails, the run stops."""
        exit_if_diverged(strategy, PROG, args.output_dir, resume_from, metrics, progress)
        rng_states = [None] * world_size  # every rank's, for rank 0 to write
        dist.all_gather_object(rng_states, rng_state(gpus))
        logged_so_far = window.totals()
        dist.all_reduce(logged_so_far)  # the logging window so far, summed over ranks
        trainer_state = TrainerState(
            step=step, epoch=epoch, next_batch=next_batch, window=LogWindow.named(logged_so_far),
            optimizer=strategy.optimizer_state(), scheduler=scheduler.state_dict(), rng=rng_states,
            geometry=geometry(args, world_size), seed=args.seed, num_examples=len(dataset),
            prompt_template=args.prompt_template,
            wandb_run_id=metrics.wandb_run_id, fingerprint=loaded.fingerprint)
        with strategy.gathered():  # ZeRO-3: the interventions whole, for rank 0 to write
            return main_rank_result(lambda: save_checkpoint(
                args.output_dir, step, reft_model, trainer_state, args.save_total_limit), device)

    # -- train ---------------------------------------------------------------------------------
    sampler, loader = training_loader(args, loaded, device)
    placeholder = loaded.collate([dataset[0]])  # zero-weight, where a rank's share falls short
    # The per-step agreement travels as a CPU tensor over gloo: the host never waits for the device.
    host_group = dist.new_group(backend="gloo",
                                timeout=datetime.timedelta(seconds=args.ddp_timeout))
    progress = tqdm(total=schedule.total_steps, initial=step, desc="training",
                    dynamic_ncols=True, disable=not is_main)
    dist.barrier()  # rank 0 may have spent a while starting wandb: every rank's clock starts now
    train_start = window_start = time.perf_counter()
    while step < schedule.total_steps:
        sampler.set_epoch(epoch)  # a new order each epoch, as with DistributedSampler
        sampler.set_start(start.next_batch if epoch == start.epoch else 0)  # a resume: mid-epoch
        for index, micro_batches in enumerate(loader, start=sampler.start):
            end_of_epoch = index == len(sampler.global_batches) - 1
            agreed = torch.tensor([*step_counts(micro_batches), stop.received is not None])
            dist.all_reduce(agreed, group=host_group)  # the step's counts, and whether to stop
            *counts, stopping = agreed.tolist()
            give_step_counts([*micro_batches, placeholder], counts)
            if stopping:  # preempted: checkpoint the last finished step, then exit non-zero
                exit_preempted(stop, step, checkpoint(epoch, next_batch=index), metrics)
            learning_rate = scheduler.get_last_lr()[0]
            missing = sampler.micro_steps(index) - len(micro_batches)  # short of another rank's
            micro_batches += [None] * strategy.placeholders(missing)
            backward_step(strategy, train_model, micro_batches, counts[0], window, device,
                          placeholder=placeholder, gpus=gpus)
            grad_norm = strategy.step(step + 1)
            step += 1
            progress.update()
            if schedule.should_log(step):
                logged = window.totals()
                dist.all_reduce(logged)  # the global loss and throughput, not rank 0's
                now = time.perf_counter()
                metrics.write(train_record(step, schedule.steps_per_epoch, LogWindow.named(logged),
                                           learning_rate=learning_rate, grad_norm=float(grad_norm),
                                           window_seconds=now - window_start,
                                           elapsed_s=now - train_start), progress)
                # the host has read the step: if one was not finite, stop before anything is saved
                exit_if_diverged(strategy, PROG, args.output_dir, resume_from, metrics, progress)
                window.reset()
                window_start = time.perf_counter()
            if schedule.should_evaluate(step, end_of_epoch):
                evaluated = evaluation_record(loaded, strategy, step, schedule.steps_per_epoch)
                metrics.write(evaluated, progress)
                window_start += evaluated["eval_s"]  # tokens/s counts training time only
                eval_time += evaluated["eval_s"]
            if schedule.should_save(step, end_of_epoch, args.save_strategy):
                checkpoint(epoch, next_batch=index + 1)
            if step == schedule.total_steps:
                break
        epoch += 1
    progress.close()
    train_time = time.perf_counter() - train_start - eval_time

    # -- output: the interventions, arguments, metrics and the last lines ------------------------
    throughput = gather_rank_report(window.tokens_seen / train_time, base_bytes, device)
    trained = f"Trained to step {step} in {train_time:.0f}s on {world_size} processes: {throughput}"
    record = finished_record(step, args, world_size, len(dataset), loaded.fingerprint)
    finish_run(args, loaded, strategy, metrics, progress, resume_from, record=record,
               trained=trained)
    print(f"Done in {time.perf_counter() - started:.0f}s.")


def exit_preempted(stop: StopSignal, step: int, path: Path, metrics: MetricsLog) -> NoReturn:
    """Stop after a stop signal: close the log, say where the checkpoint is, and exit 128 + the
    signal's number."""
    metrics.close()
    if not metrics.disable:  # rank 0's line; a rank the signal did not come to exits 1
        print(stop.stopped_line(PROG, step, path), file=sys.stderr)
    sys.exit(stop.exit_code)


def backward_step(strategy, train_model, micro_batches: list[dict | None], step_label_tokens: int,
                  window: LogWindow, device: torch.device, *, placeholder: dict,
                  gpus: list[int]) -> None:
    """Run forward and backward over the micro-batches of one optimizer step, each weighted by the
    label tokens of the whole global batch. A None: a zero-weight `placeholder` (where this rank's
    share falls short), which draws no dropout masks (the host's and `gpus`' RNG states are put
    back), so the real micro-batches draw the same ones under every strategy."""
    for micro_step, batch in enumerate(micro_batches):
        with (strategy.micro_step(last=micro_step == len(micro_batches) - 1),
              torch.random.fork_rng(gpus, enabled=batch is None)):
            summed_loss = summed_token_loss(train_model, batch or placeholder, device)
            if batch is None:
                summed_loss = summed_loss * 0.0
            strategy.backward(token_weighted_loss(summed_loss, step_label_tokens,
                                                  dist.get_world_size()))
        if batch is not None:
            window.add(summed_loss, batch)


@dataclass
class DataAndModel:
    """What load_data_and_model returns: the data, the ReFT model and what both are read with."""

    tokenizer: PreTrainedTokenizerBase
    reft_model: torch.nn.Module  # pyreft's ReftModel around the base
    dataset: Dataset  # tokenized
    eval_dataset: Dataset | None
    eval_order: list[list[int]]  # the evaluation batches (alpaca.sampler.eval_batches)
    position: tuple[int, int]  # the intervened positions (alpaca.flag_values.parse_position)
    num_layers: int  # intervened layers (alpaca.model.num_intervened_layers)
    collate: Collator
    fingerprint: dict  # what its checkpoints are bound to (alpaca.resume.training_fingerprint)
    held_out: Dataset | None  # the records --eval_split_ratio held out, untokenized


def load_data_and_model(args: argparse.Namespace, strategy, dtype: torch.dtype,
                        device: torch.device) -> DataAndModel:
    """Load the data and build the ReFT model, checking what can be checked before the weights
    load."""
    records, eval_records = run_checked(lambda: load_training_splits(args), device)  # or all stop
    # caches (model conversion, tokenization): each node's first process fills them, the others read
    model_path = first_on_local_main(lambda: check_model(args), device)
    model, tokenizer = strategy.load_base(model_path, dtype, args.cache_dir)
    dataset, eval_dataset = first_on_local_main(
        lambda: tokenize_splits([records, eval_records], tokenizer, args), device)
    set_attention(model, args.attn_implementation)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if args.torch_compile:
        compile_decoder_layers(model)
    position = parse_position(args.position)
    torch.manual_seed(args.seed)  # the interventions' initial weights depend on the seed only
    reft_model = build_reft_model(model, args.layers, position, args.share_weights,
                                  low_rank_dimension=args.rank, dropout=args.dropout,
                                  intervention=args.intervention, component=args.component)
    torch.manual_seed(args.seed + dist.get_rank())  # dropout differs per rank, as the data does
    num_layers = num_intervened_layers(reft_model, position, args.share_weights)
    collate = Collator(tokenizer.pad_token_id, position, args.share_weights, num_layers,
                       args.pad_to_multiple_of)
    # what its checkpoints are bound to
    fingerprint = training_fingerprint(args, records, model_path, dtype)
    eval_order = (eval_batches(np.array(eval_dataset["length"]), args.per_device_eval_batch_size)
                  if eval_dataset else [])
    return DataAndModel(
        tokenizer=tokenizer, reft_model=reft_model, dataset=dataset, eval_dataset=eval_dataset,
        eval_order=eval_order, position=position, num_layers=num_layers, collate=collate,
        fingerprint=fingerprint,
        held_out=eval_records if args.eval_split_ratio is not None else None)


def training_start(args: argparse.Namespace, loaded: DataAndModel, strategy, optimizer,
                   scheduler, *, gpus: list[int],
                   resume_from: Path | None) -> tuple[TrainingStart, torch.nn.Module]:
    """Place the ReFT model for training (strategy.wrap) and say where training starts: a new run at
    its first step; a resumed one where its checkpoint left off, the checkpoint's state loaded into
    the interventions, the optimizer, the schedule and the random generators of `gpus`."""
    start = TrainingStart()
    if resume_from is not None:
        saved = main_rank_result(lambda: load_checkpoint(resume_from), strategy.device)
        start = restore_training_state(saved, args, loaded.reft_model, scheduler, gpus,
                                       rank=dist.get_rank(), world_size=dist.get_world_size(),
                                       num_examples=len(loaded.dataset),
                                       fingerprint=loaded.fingerprint)
    return start, strategy.wrap(loaded.reft_model, optimizer, scheduler, start.optimizer_state)


def training_loader(args: argparse.Namespace, loaded: DataAndModel,
                    device: torch.device) -> tuple[DistributedGlobalBatchSampler, DataLoader]:
    """Build the global batch plan and its DataLoader: one item per optimizer step, that step's
    micro-batches."""
    lengths = np.array(loaded.dataset["length"])
    sampler = DistributedGlobalBatchSampler(
        len(loaded.dataset), args.per_device_train_batch_size, args.gradient_accumulation_steps,
        num_replicas=dist.get_world_size(), rank=dist.get_rank(),  # this rank's share of a step
        seed=args.seed, lengths=lengths if args.group_by_length else None,
        packing=(lengths, args.packing_max_tokens) if args.packing_max_tokens else None)
    loader = DataLoader(
        loaded.dataset, batch_sampler=sampler, pin_memory=device.type == "cuda",
        collate_fn=StepCollator(loaded.collate, args.per_device_train_batch_size,
                                args.packing_max_tokens),
        # --dataloader_num_workers collate the steps ahead of the loop; why these settings:
        # docs/performance.md#dataloader-workers
        num_workers=args.dataloader_num_workers, persistent_workers=False,
        worker_init_fn=dataloader_worker_init, generator=torch.Generator())
    return sampler, loader


def evaluation_record(loaded: DataAndModel, strategy, step: int, steps_per_epoch: int) -> dict:
    """Compute the eval loss over the whole evaluation set; return its log record, whose `eval_s`
    is the time it took."""
    eval_start = time.perf_counter()
    totals = evaluate(loaded.reft_model, loaded.eval_dataset, loaded.eval_order, loaded.collate,
                      strategy.device, rank=dist.get_rank(), world_size=dist.get_world_size(),
                      sharded_base=strategy.shards_base)
    dist.all_reduce(totals)  # each eval example once, weighted by its label tokens
    return eval_record(step, steps_per_epoch, totals.tolist(), len(loaded.eval_dataset),
                       time.perf_counter() - eval_start)


def finish_run(args: argparse.Namespace, loaded: DataAndModel, strategy, metrics: MetricsLog,
               progress, resume_from: Path | None, *, record: dict, trained: str) -> None:
    """End the run: stop if a step was not finite (alpaca.divergence); else write the output, with
    `record` (alpaca.resume.finished_record), and say so; then, the output safe, sample answers."""
    exit_if_diverged(strategy, PROG, args.output_dir, resume_from, metrics, progress)
    with strategy.gathered():  # rank 0 writes; if that fails, every rank exits instead of hanging
        run_checked(lambda: save_and_report(args, loaded, metrics, record, trained),
                    participate=not metrics.disable, device=strategy.device)
    # a sharded base answers with every rank in step, a replicated one after the last collective
    if args.num_sample_answers > 0 and (not metrics.disable or strategy.shards_base):
        print(sample_answers(loaded.reft_model, loaded.tokenizer, args, loaded.position,
                             loaded.num_layers, strategy.device, synced_ranks=strategy.shards_base))


def save_and_report(args: argparse.Namespace, loaded: DataAndModel, metrics: MetricsLog,
                    finished: dict, trained: str) -> None:
    """Write rank 0's output: the interventions (pyreft format), arguments, metrics, the record
    that the run `finished` (alpaca.resume.finished_record) and loss.png; then say so."""
    save_output(loaded.reft_model, metrics, args.output_dir, finished)
    print(f"{trained}; {metrics.loss_summary()}. Interventions (pyreft format), arguments, metrics "
          f"and loss.png in {args.output_dir}/")


if __name__ == "__main__":
    main(ARGS)
