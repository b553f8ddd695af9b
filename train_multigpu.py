"""Train LoReFT interventions on Alpaca instruction data on N processes (DDP), the same model as train.py.

    torchrun --nproc_per_node 8 train_multigpu.py <train.py flags>
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 train_multigpu.py ...
    accelerate launch --num_processes 8 train_multigpu.py ...
    python train_multigpu.py ...         # one process

Every rank walks the same global batch schedule as train.py (per_device x world_size x accumulation examples
a step) and takes its own share of each global batch; the loss is weighted by the label tokens of the
whole global batch. So N processes compute the gradient one process computes, and train the same model.
"""

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from alpaca.args import exit_on_usage_error, parse_args, resolve_device_defaults

PROG = "train_multigpu.py"

if __name__ == "__main__":  # --help and usage errors answer here, before the heavy imports below
    ARGS = parse_args(PROG, multigpu=True)

import contextlib
import datetime
import gc
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from alpaca.checkpoint import TrainerState, load_checkpoint, prepare_output_dir, save_checkpoint, save_output
from alpaca.collate import Collator, StepCollator, give_step_counts, step_counts
from alpaca.data import load_splits, prepare_dataset
from alpaca.device_map import gpu_group
from alpaca.distributed import (
    first_on_local_main,
    gather_rank_report,
    main_rank_result,
    releasing_process_group,
    run_checked,
)
from alpaca.divergence import exit_if_diverged
from alpaca.errors import UsageError
from alpaca.flag_values import parse_position
from alpaca.generation import sample_answers
from alpaca.launch import StopSignal, wait_for_launcher
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
from alpaca.optim import StepSchedule, build_optimizer
from alpaca.output import LogWindow, MetricsLog, eval_record, quiet_non_main_rank, save_args, start_line, train_record
from alpaca.resume import (
    check_finished,
    finished_record,
    geometry,
    restore_training_state,
    rng_state,
    training_fingerprint,
)
from alpaca.sampler import DistributedGlobalBatchSampler, eval_batches, loader_workers
from alpaca.strategy import choose_strategy, local_parameter_bytes


def main(args: argparse.Namespace) -> None:
    try:
        train_in_process_group(args)
    except UsageError as error:
        exit_on_usage_error(PROG, error)


def train_in_process_group(args) -> None:
    """This process's device(s) and what they decide (dtype, attention check, device defaults of flags), then the
    process group's life: created, the training run in it, destroyed."""
    started = time.perf_counter()
    # -- launch environment: torchrun / accelerate set these; plain `python` is a world of one ------------
    if "RANK" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free_port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port))
    local_rank = int(os.environ["LOCAL_RANK"])
    gpus = []  # this process's GPUs: one, or with --device_map an equal group of the node's
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        # Every rank of the node sees the same counts and stops here; local rank 0 says why. The others wait
        # for torchrun to stop them, since one leaving first could get rank 0 stopped before it has printed.
        # A launcher without LOCAL_WORLD_SIZE leaves each rank to judge (and report) itself.
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
        problem = None
        if processes > count:
            problem = (f"{processes} processes on this node but {count} GPU(s) visible; launch with --nproc_per_node "
                       f"{count}")
        elif args.device_map is not None and count % processes:
            divisors = ", ".join(str(n) for n in range(1, count + 1) if count % n == 0)
            problem = (f"--device_map gives each process an equal group of the node's GPUs, but {count} GPUs do not "
                       f"divide among {processes} processes; launch with --nproc_per_node one of {divisors}")
        if problem:
            reports = local_rank == 0 or "LOCAL_WORLD_SIZE" not in os.environ
            if not reports:
                wait_for_launcher()
            sys.exit(f"{PROG}: error: {problem}" if reports else 2)
        # local ranks, not global ones: nodes count from 0
        gpus = gpu_group(local_rank, processes, count) if args.device_map is not None else [local_rank]
        device = torch.device("cuda", gpus[0])
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
    resolve_device_defaults(args, device.type)
    dtype = resolve_dtype(args.dtype, device)
    check_attention(args.attn_implementation, device, dtype)

    # -- process group --------------------------------------------------------------------------------
    backend = args.ddp_backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.ddp_timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        with releasing_process_group():  # what holds the group lets go of it, however training ends
            train(args, device, dtype, gpus, backend, started)
    finally:
        dist.destroy_process_group()
        gc.collect()  # FSDP's sharded modules can become collectable only once the group is gone


def train(args, device, dtype, gpus: list[int], backend: str, started: float) -> None:
    """Data, model, the training loop and the output, on every rank of the process group."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    is_main = rank == 0
    if not is_main:  # other ranks print errors only
        quiet_non_main_rank()
    stop = StopSignal()  # torchrun forwards SIGTERM/SIGINT to every rank
    position = parse_position(args.position)
    strategy = choose_strategy(args, device, dtype, gpus)  # DDP (--device_map), --fsdp or --deepspeed: asked once
    resume_from, finished = main_rank_result(lambda: prepare_output_dir(args), is_main, device)  # before any load

    # -- data and model --------------------------------------------------------------------------------
    tokenizer, reft_model, dataset, eval_dataset, num_layers, collate, fingerprint = load_data_and_model(
        args, strategy, dtype, position, device)

    # -- optimization: global batch = per_device x world_size x accumulation, train.py's with one process ----
    schedule = StepSchedule.from_args(args, len(dataset), world_size)
    if finished is not None:  # --resume_from_checkpoint auto where this run finished (a requeue): every rank returns
        print(check_finished(finished, args, world_size, len(dataset), fingerprint, schedule.total_steps))
        return
    optimizer, scheduler = build_optimizer(reft_model, args, schedule)
    step, start_epoch, start_batch, carried_window, wandb_run_id, optimizer_state = 0, 0, 0, {}, None, None
    if resume_from is not None:
        loaded = main_rank_result(lambda: load_checkpoint(resume_from), is_main, device)
        step, start_epoch, start_batch, carried_window, wandb_run_id = restore_training_state(
            loaded, args, reft_model, None, scheduler, rank, world_size, len(dataset), gpus, fingerprint)
        optimizer_state = loaded[1]["optimizer"]  # the strategy loads it once the parameters are placed
    summary = describe(reft_model, len(dataset), device)  # before a strategy partitions the parameters
    train_model = strategy.wrap(reft_model, optimizer, scheduler, optimizer_state)
    base_bytes = local_parameter_bytes(reft_model.model)
    metrics = None  # rank 0's
    if is_main:
        placement = f" | {backend} | base model {strategy.layout}: {base_bytes / 2**20:.1f} MiB of parameters on rank 0"
        print(start_line(summary, schedule, args, eval_dataset and len(eval_dataset), resume_from, step,
                         time.perf_counter() - started, world_size, placement), flush=True)
        resolved = dict(world_size=world_size, global_batch_size=schedule.global_batch_size,
                        total_steps=schedule.total_steps, base_parameter_bytes_per_rank=base_bytes)
        save_args(args, args.output_dir, **resolved)
        metrics = MetricsLog(args.output_dir, args, resume_step=step, wandb_run_id=wandb_run_id, **resolved)
    window = LogWindow(device, carried_window)

    def checkpoint(epoch: int, next_batch: int):
        """Every rank's RNG goes to rank 0, which writes; if writing fails, every rank stops."""
        exit_if_diverged(strategy, PROG, args.output_dir, metrics, is_main)
        rng_states = [None] * world_size
        dist.all_gather_object(rng_states, rng_state(gpus))
        logged_so_far = window.totals()  # the logging window so far, summed over ranks
        dist.all_reduce(logged_so_far)
        trainer_state = TrainerState(
            step=step, epoch=epoch, next_batch=next_batch, window=LogWindow.named(logged_so_far),
            optimizer=strategy.optimizer_state(),  # under DeepSpeed, assembled from the partitions
            scheduler=scheduler.state_dict(), rng=rng_states, geometry=geometry(args, world_size), seed=args.seed,
            num_examples=len(dataset), prompt_template=args.prompt_template,
            wandb_run_id=metrics.wandb_run_id if is_main else None, fingerprint=fingerprint)
        with strategy.gathered():
            return run_checked(lambda: save_checkpoint(args.output_dir, step, reft_model, trainer_state,
                                                       args.save_total_limit), participate=is_main, device=device)

    # -- data: each rank's share of each global batch, one DataLoader item per optimizer step -------------
    sampler, loader, placeholder, eval_order = data_pipeline(args, dataset, eval_dataset, collate, device, rank,
                                                             world_size)
    # The per-step agreement travels as a CPU tensor, over gloo: the host never waits for the device for it.
    host_group = None if backend == "gloo" else dist.new_group(backend="gloo")

    # -- train ------------------------------------------------------------------------------------
    progress = tqdm(total=schedule.total_steps, initial=step, desc="training", dynamic_ncols=True, disable=not is_main)
    eval_time, epoch = 0.0, start_epoch
    dist.barrier()  # rank 0 may have spent a while starting wandb: start every rank's clock together
    train_start = window_start = time.perf_counter()
    while step < schedule.total_steps:
        sampler.set_epoch(epoch)  # a new order each epoch, as with DistributedSampler
        sampler.set_start(start_batch if epoch == start_epoch else 0)  # a resumed run goes on mid-epoch
        for index, micro_batches in enumerate(loader, start=sampler.start):
            end_of_epoch = index == len(sampler.global_batches) - 1
            # One all-reduce: the step's counts (counted on the host by the collator), and whether to stop.
            agreed = torch.tensor([*step_counts(micro_batches), stop.received is not None])
            dist.all_reduce(agreed, group=host_group)
            *counts, stopping = agreed.tolist()
            give_step_counts([*micro_batches, placeholder], counts)
            step_label_tokens = counts[0]
            if stopping:  # preempted: checkpoint the last finished step, then exit non-zero
                exit_preempted(stop, step, checkpoint(epoch, next_batch=index), metrics)
            learning_rate = scheduler.get_last_lr()[0]
            backward_step(strategy, train_model, micro_batches, sampler.micro_steps(index), placeholder,
                          step_label_tokens, window, device, gpus)
            grad_norm = strategy.step(step + 1)
            step += 1
            progress.update()
            if schedule.should_log(step):
                logged = window.totals()
                dist.all_reduce(logged)  # the global loss and throughput, not rank 0's
                if is_main:
                    now = time.perf_counter()
                    metrics.write(train_record(step, schedule.steps_per_epoch, LogWindow.named(logged), learning_rate,
                                               float(grad_norm), now - window_start, now - train_start), progress)
                # the host has read this step: where one was not finite, stop before anything is saved
                exit_if_diverged(strategy, PROG, args.output_dir, metrics, is_main)
                window.reset()
                window_start = time.perf_counter()
            if schedule.should_evaluate(step, end_of_epoch):
                eval_start = time.perf_counter()
                totals = evaluate(reft_model, eval_dataset, eval_order, collate, device, rank, world_size,
                                  strategy.shards_base)
                dist.all_reduce(totals)  # every eval example counted once, weighted by its label tokens
                seconds = time.perf_counter() - eval_start
                if is_main:
                    metrics.write(eval_record(step, schedule.steps_per_epoch, totals.tolist(), len(eval_dataset),
                                              seconds), progress)
                window_start += seconds  # tokens/s counts training time only
                eval_time += seconds
            if schedule.should_save(step, end_of_epoch, args.save_strategy):
                checkpoint(epoch, next_batch=index + 1)
            if step == schedule.total_steps:
                break
        epoch += 1
    progress.close()
    train_time = time.perf_counter() - train_start - eval_time

    # -- output: throughput and peak memory of every rank; rank 0 writes, and if that fails every rank exits
    # with an error instead of hanging. A sharded base answers only with every rank taking part.
    exit_if_diverged(strategy, PROG, args.output_dir, metrics, is_main)
    throughput = gather_rank_report(window.tokens_seen / train_time, base_bytes, device)
    answers = (sample_answers(reft_model, tokenizer, args, position, num_layers, synced_ranks=strategy.shards_base)
               if args.num_sample_answers > 0 and (is_main or strategy.shards_base) else None)
    record = finished_record(step, args, world_size, len(dataset), fingerprint)
    with strategy.gathered():
        run_checked(lambda: save_and_report(args, reft_model, metrics, record, train_time, throughput, answers,
                                            started), participate=is_main, device=device)


def exit_preempted(stop: StopSignal, step: int, path: Path | None, metrics: MetricsLog | None) -> NoReturn:
    """Rank 0 (the one with `metrics`) closes its log and says where the checkpoint is. Every rank exits 128 + the
    signal's number, or 1 where the signal came to another rank."""
    if metrics is not None:
        metrics.close()
        print(f"{PROG}: stopped by {stop.name or 'a signal to another rank'} after step {step}; checkpoint in "
              f"{path}. Resume with --resume_from_checkpoint auto", file=sys.stderr)
    sys.exit(stop.exit_code if stop.received else 1)


def data_pipeline(args, dataset, eval_dataset, collate, device, rank: int, world_size: int):
    """This rank's share of each global batch, one DataLoader item per optimizer step; the placeholder batch run
    at zero weight where a rank's share of a global batch falls short; the evaluation's batches."""
    lengths = np.array(dataset["length"])
    sampler = DistributedGlobalBatchSampler(
        len(dataset), args.per_device_train_batch_size, args.gradient_accumulation_steps, num_replicas=world_size,
        rank=rank, seed=args.seed, lengths=lengths if args.group_by_length else None,
        packing=(lengths, args.packing_max_tokens) if args.packing_max_tokens else None)
    # its micro-batches collated in workers (--dataloader_num_workers), ahead of the step
    loader = DataLoader(dataset, batch_sampler=sampler, pin_memory=device.type == "cuda",
                        collate_fn=StepCollator(collate, args.per_device_train_batch_size, args.packing_max_tokens),
                        **loader_workers(args.dataloader_num_workers))
    placeholder = collate([dataset[0]])
    eval_order = eval_batches(np.array(eval_dataset["length"]), args.per_device_eval_batch_size) if eval_dataset else []
    return sampler, loader, placeholder, eval_order


def save_and_report(args, reft_model, metrics: MetricsLog, finished: dict, train_time: float, throughput: str,
                    answers: str | None, started: float) -> None:
    """Rank 0's output: the interventions (pyreft format), arguments, metrics and loss.png, the record that the run
    `finished` (alpaca.resume.finished_record), and the last lines."""
    save_output(reft_model, metrics, args.output_dir, finished)
    print(f"Trained to step {finished['step']} in {train_time:.0f}s on {dist.get_world_size()} processes: "
          f"{throughput}; {metrics.loss_summary()}. Interventions (pyreft format), arguments, metrics and loss.png in "
          f"{args.output_dir}/")
    if answers:
        print(answers)
    print(f"Done in {time.perf_counter() - started:.0f}s.")


def backward_step(strategy, train_model, micro_batches: list[dict], micro_steps: int, placeholder: dict,
                  step_label_tokens: int, window, device, gpus: list[int]) -> None:
    """Forward and backward of this rank's micro-batches of one optimizer step, each weighted by the label
    tokens of the whole global batch. A share short of `micro_steps` (the accumulation steps; with --packing,
    the most packs of any rank) runs zero-weight placeholders, as many as the strategy's collectives need;
    they draw no dropout masks (the RNG states of the host and of the process's `gpus` are put back), so the
    real micro-batches draw the same ones under every strategy."""
    missing = micro_steps - len(micro_batches)
    micro_batches = [*micro_batches, *[None] * strategy.placeholders(missing)]
    for micro_step, batch in enumerate(micro_batches):
        with (strategy.micro_step(last=micro_step == len(micro_batches) - 1),
              torch.random.fork_rng(gpus) if batch is None else contextlib.nullcontext()):
            summed_loss = summed_token_loss(train_model, batch or placeholder, device)
            if batch is None:
                summed_loss = summed_loss * 0.0
            strategy.backward(token_weighted_loss(summed_loss, step_label_tokens, dist.get_world_size()))
        if batch is not None:
            window.add(summed_loss, batch)


def load_data_and_model(args, strategy, dtype, position: tuple[int, int], device):
    """The data and the ReFT model, checked before the weights load. Caches are filled by each node's first
    process (model conversion, tokenization), then read by the others."""
    rank, local_rank, world_size = dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()
    records, eval_records = run_checked(
        lambda: load_splits(args.data_path, args.eval_data_path, args.eval_split_ratio, args.max_n_train_example,
                            args.seed, args.field_map, args.data_split, args.data_config, args.data_format,
                            args.eval_data_split), participate=True, device=device)
    model_path = first_on_local_main(lambda: check_model(args), local_rank, device)
    model, tokenizer = strategy.load_base(model_path, dtype, args.cache_dir)
    dataset, eval_dataset = first_on_local_main(
        lambda: [None if split is None
                 else prepare_dataset(split, tokenizer, args.model_max_length, args.cache_dir, args.prompt_template)
                 for split in (records, eval_records)], local_rank, device)
    if len(dataset) < world_size:
        raise UsageError(f"{len(dataset)} training examples for {world_size} processes: every process needs "
                         "at least one; use fewer processes or more data")
    set_attention(model, args.attn_implementation)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if args.torch_compile:
        compile_decoder_layers(model)
    torch.manual_seed(args.seed)  # the same initial interventions on every rank (and as in train.py)
    reft_model = build_reft_model(model, args.layers, position, args.share_weights, low_rank_dimension=args.rank,
                                  dropout=args.dropout, intervention=args.intervention, component=args.component)
    torch.manual_seed(args.seed + rank)  # dropout differs per rank, like the data each rank sees
    num_layers = num_intervened_layers(reft_model, position, args.share_weights)
    collate = Collator(tokenizer.pad_token_id, position, args.share_weights, num_layers, args.pad_to_multiple_of)
    fingerprint = training_fingerprint(args, records, model)  # what its checkpoints are bound to
    return tokenizer, reft_model, dataset, eval_dataset, num_layers, collate, fingerprint


if __name__ == "__main__":
    main(ARGS)
