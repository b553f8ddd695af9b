"""Train LoReFT interventions on Alpaca instruction data on N processes (DDP), the same model as train.py.

    torchrun --nproc_per_node 8 train_multigpu.py <train.py flags>
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 train_multigpu.py ...
    accelerate launch --num_processes 8 train_multigpu.py ...
    python train_multigpu.py ...         # one process

Every rank walks the same global batch plan as train.py (per_device x world_size x accumulation examples
a step) and takes its own share of each global batch; the loss is weighted by the label tokens of the
whole global batch. So N processes compute the gradient one process computes, and train the same model.
"""

import os

from alpaca.args import exit_on_usage_error, parse_args
from alpaca.errors import UsageError

PROG = "train_multigpu.py"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(PROG, argv, multigpu=True)  # before the heavy imports: --help and usage errors are instant
    try:
        train(args)
    except UsageError as error:
        exit_on_usage_error(PROG, error)


def train(args) -> None:
    """The process group's life: create it, run the training, destroy it."""
    import socket
    import sys
    import time

    import torch

    from alpaca.distributed import process_group

    started = time.perf_counter()
    # -- process group: torchrun / accelerate set these; plain `python` is a world of one ----------------
    if "RANK" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free_port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        # Every rank of the node sees the same counts and stops here; local rank 0 says why. The others wait
        # for torchrun to stop them, since one leaving first could get rank 0 stopped before it has printed.
        # A launcher without LOCAL_WORLD_SIZE leaves each rank to judge (and report) itself.
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
        if processes > gpus:
            reports = local_rank == 0 or "LOCAL_WORLD_SIZE" not in os.environ
            if not reports:
                time.sleep(30)
            sys.exit(f"{PROG}: error: {processes} processes on this node but {gpus} GPU(s) visible; launch with "
                     f"--nproc_per_node {gpus}" if reports else 2)
        device = torch.device("cuda", local_rank)  # the local rank, not the global one: nodes count from 0
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
    backend = args.ddp_backend or ("nccl" if device.type == "cuda" else "gloo")
    with process_group(backend, args.ddp_timeout, device):
        run(args, device, backend, started)


def run(args, device, backend: str, started: float) -> None:
    """Everything between the process group's creation and its destruction."""
    import contextlib
    import resource
    import sys
    import time

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from alpaca import deepspeed as zero  # the --deepspeed strategy (DeepSpeed ZeRO)
    from alpaca.args import parse_position, resolve_device_defaults
    from alpaca.checkpoint import (
        StopSignal,
        load_checkpoint,
        prepare_output_dir,
        restore_training_state,
        rng_state,
        save_checkpoint,
        storage_errors,
        trainer_state,
    )
    from alpaca.data import (
        Collator,
        GlobalBatchSampler,
        StepCollator,
        dataloader_worker_init,
        eval_batches,
        load_splits,
        prepare_dataset,
    )
    from alpaca.distributed import (
        average_gradients,
        broadcast_from_rank_zero,
        first_on_local_main,
        local_parameter_bytes,
        no_forward_buffer_sync,
        run_checked,
        shard_base_model,
    )
    from alpaca.generation import sample_answers
    from alpaca.loss import evaluate, summed_token_loss, token_weighted_loss
    from alpaca.model import (
        build_reft_model,
        check_model,
        describe,
        enable_gradient_checkpointing,
        intervention_parameters,
        load_base_model,
        num_intervened_layers,
        resolve_dtype,
    )
    from alpaca.optim import StepPlan, build_optimizer, clip_gradients
    from alpaca.output import MetricsLog, eval_record, plot_loss, save_args, save_interventions, train_record
    from alpaca.sharding import load_shards
    from alpaca.workarounds import index_tensors_on

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    is_main = rank == 0
    if not is_main:  # other ranks print errors only
        quiet_non_main_rank()
    stop = StopSignal()  # torchrun forwards SIGTERM/SIGINT to every rank
    resolve_device_defaults(args, device.type)
    position = parse_position(args.position)
    dtype = resolve_dtype(args.dtype, device)
    deepspeed_config = args.deepspeed_config if args.deepspeed else None
    if deepspeed_config:
        zero.check_for_device(deepspeed_config, args.deepspeed, device, dtype)
    # A sharded base answers only when every rank runs each forward (evaluation, sample answers).
    shards_base = bool(args.fsdp) or bool(deepspeed_config) and zero.stage(deepspeed_config) == 3
    # Refuses to clobber an earlier run, before anything is loaded; rank 0 owns output_dir.
    resume_from = run_checked(lambda: prepare_output_dir(args), participate=is_main, device=device)

    # -- data and model: checked before the weights load; caches are filled by each node's first
    # process (model conversion, tokenization), then read by the others ------------------------------
    records, eval_records = run_checked(
        lambda: load_splits(args.data_path, args.eval_data_path, args.eval_split_ratio, args.max_n_train_example,
                            args.seed, args.field_map), participate=True, device=device)
    model_path = first_on_local_main(lambda: check_model(args), local_rank, device)
    # Under --fsdp the base is built empty (meta device); once sharded, each rank reads only its shards.
    model, tokenizer = load_base_model(model_path, dtype,
                                       torch.device("meta") if args.fsdp else device, args.cache_dir)
    dataset, eval_dataset = first_on_local_main(
        lambda: [None if split is None
                 else prepare_dataset(split, tokenizer, args.model_max_length, args.cache_dir, args.prompt_template)
                 for split in (records, eval_records)], local_rank, device)
    if len(dataset) < world_size:
        raise UsageError(f"{len(dataset)} training examples for {world_size} processes: every process needs "
                         "at least one; use fewer processes or more data")
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    torch.manual_seed(args.seed)  # the same initial interventions on every rank (and as in train.py)
    reft_model = build_reft_model(model, args.layers, position, args.share_weights, args.rank, args.dropout,
                                  args.intervention)
    torch.manual_seed(args.seed + rank)  # dropout differs per rank, like the data each rank sees
    num_layers = num_intervened_layers(reft_model, position, args.share_weights)
    collate = Collator(tokenizer.pad_token_id, position, args.share_weights, num_layers, args.pad_to_multiple_of)
    parameters = [parameter for _, parameter in intervention_parameters(reft_model)]

    # -- optimization: the global batch is the same as train.py's with world_size = 1 ---------------
    plan = StepPlan.from_args(args, len(dataset), world_size)
    optimizer, scheduler = build_optimizer(reft_model, args, plan)
    parameter_groups = [list(group["params"]) for group in optimizer.param_groups]  # DeepSpeed swaps them out
    step, start_epoch, start_batch, window, wandb_run_id = 0, 0, 0, [0.0, 0.0, 0.0], None
    # broadcast_object_list needs the resume decision on every rank, not only rank 0
    resume = [resume_from]
    dist.broadcast_object_list(resume, src=0)
    if resume[0] is not None:
        # Rank 0 reads the checkpoint and sends it: other nodes need not see rank 0's disk.
        loaded = [run_checked(lambda: load_checkpoint(resume[0]), participate=is_main, device=device)]
        dist.broadcast_object_list(loaded, src=0)
        # Under DeepSpeed the optimizer state goes into its partitions, once its engine exists.
        step, start_epoch, start_batch, window, wandb_run_id = restore_training_state(
            loaded[0], args, reft_model, None if args.deepspeed else optimizer, scheduler, rank, world_size,
            len(dataset), device)

    # -- DDP, FSDP for the base, or DeepSpeed ZeRO: only the interventions train ---------------------
    engine = None  # DeepSpeed's: it reduces, clips and steps
    if args.fsdp:  # the base is sharded; the interventions' gradients are averaged by hand, once a step
        offload = "offload" in args.fsdp.split()
        shard_base_model(model, device, offload=offload)
        load_shards(model, model_path, torch.device("cpu") if offload else device, args.cache_dir)
        reft_model.interventions.to(device)
        index_tensors_on(reft_model, device)
        broadcast_from_rank_zero([*reft_model.interventions.parameters(), *reft_model.interventions.buffers()])
        train_model = reft_model
    elif args.deepspeed:
        engine = train_model = zero.initialize(reft_model, optimizer, scheduler, deepspeed_config)
        if resume[0] is not None:
            zero.load_optimizer_state(engine, optimizer, parameter_groups, loaded[0][1]["optimizer"])
    else:  # DDP neither broadcasts nor reduces the frozen base. Buffers (rotary tables, the rotation's
        # fixed base) never change: no re-broadcast before each forward.
        train_model = DistributedDataParallel(reft_model, find_unused_parameters=False, **no_forward_buffer_sync(),
                                              device_ids=[local_rank] if device.type == "cuda" else None)
    with zero.gathered(reft_model.interventions, deepspeed_config):  # ZeRO-3 partitions them: compare them whole
        check_replicated(parameters, device, ddp_model=None if args.fsdp or args.deepspeed else train_model)
    backward = torch.Tensor.backward if engine is None else lambda loss: zero.micro_step(engine, loss)
    base_bytes = local_parameter_bytes(model)
    layout = ("sharded (FSDP)" if args.fsdp else "replicated (DDP)" if engine is None else
              f"{'sharded' if shards_base else 'replicated'} (DeepSpeed ZeRO-{zero.stage(deepspeed_config)})")
    if is_main:
        print(f"{describe(reft_model, len(dataset), device)}\n"
              f"global batch {plan.global_batch_size} = {args.per_device_train_batch_size} per device x "
              f"{world_size} processes x {args.gradient_accumulation_steps} accumulation | {plan.total_steps} "
              f"steps ({plan.steps_per_epoch} per epoch) | {backend} | base model "
              f"{layout}: {base_bytes / 2**20:.1f} MiB of parameters on rank 0"
              + (f" | eval: {len(eval_dataset)} examples, {args.eval_strategy}" if eval_dataset else "")
              + (f" | resuming {resume[0]} at step {step}" if resume[0] else "")
              + f" | ready in {time.perf_counter() - started:.1f}s", flush=True)
        resolved = dict(world_size=world_size, global_batch_size=plan.global_batch_size,
                        total_steps=plan.total_steps, base_parameter_bytes_per_rank=base_bytes)
        save_args(args, args.output_dir, **resolved)
        metrics = MetricsLog(args.output_dir, args, resume_step=step, wandb_run_id=wandb_run_id, **resolved)

    def checkpoint(epoch: int, next_batch: int):
        """Every rank's RNG goes to rank 0, which writes; if writing fails, every rank stops."""
        rng_states = [None] * world_size
        dist.all_gather_object(rng_states, rng_state(device))
        global_window = window.clone()  # the logging window so far, summed over ranks
        dist.all_reduce(global_window)
        # Under DeepSpeed every rank assembles torch's full state from the partitions (collectives).
        optimizer_state = (optimizer.state_dict() if engine is None
                           else zero.optimizer_state(engine, optimizer, parameter_groups))
        with zero.gathered(reft_model.interventions, deepspeed_config):
            return run_checked(lambda: save_checkpoint(args.output_dir, step, reft_model, trainer_state(
                step=step, epoch=epoch, next_batch=next_batch, window=global_window.tolist(),
                optimizer_state=optimizer_state, scheduler=scheduler, rng_states=rng_states, args=args,
                world_size=world_size, num_examples=len(dataset), wandb_run_id=metrics.wandb_run_id),
                args.save_total_limit), participate=is_main, device=device)

    # -- data: each rank's share of each global batch, one item per optimizer step, collated in workers ------
    sampler = GlobalBatchSampler(len(dataset), args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                 num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed,
                                 lengths=np.array(dataset["length"]) if args.group_by_length else None)
    loader = DataLoader(dataset, batch_sampler=sampler,
                        collate_fn=StepCollator(collate, args.per_device_train_batch_size),
                        num_workers=args.dataloader_num_workers, pin_memory=device.type == "cuda",
                        persistent_workers=args.dataloader_num_workers > 0, worker_init_fn=dataloader_worker_init,
                        # Each epoch's iterator draws a seed for its workers: from this generator, not from the
                        # global RNG, whose stream (dropout) a resumed run must continue exactly.
                        generator=torch.Generator())
    # What a rank whose share of a (partial) global batch falls short of its micro-steps runs, at zero weight.
    placeholder = collate([dataset[0]])
    rng_devices = [device] if device.type == "cuda" else []  # fork_rng saves the CPU generator's state always
    # Each rank evaluates every world_size-th batch; with a sharded base all ranks run as many forwards.
    eval_plan = (eval_batches(np.array(eval_dataset["length"]), args.per_device_eval_batch_size)
                 if eval_dataset else [])
    eval_forwards = -(-len(eval_plan) // world_size) if shards_base else None
    # The per-step agreement travels as a CPU tensor, over gloo: the host never waits for the device for it.
    host_group = None if backend == "gloo" else dist.new_group(backend="gloo")

    # -- train ------------------------------------------------------------------------------------
    progress = tqdm(total=plan.total_steps, initial=step, desc="training", dynamic_ncols=True,
                    disable=not is_main)
    # loss sum, label tokens, tokens seen: on the device, read once per logging step
    window = torch.tensor(window, dtype=torch.float64, device=device)
    rank_tokens, eval_time, epoch = 0, 0.0, start_epoch
    dist.barrier()  # rank 0 may have spent a while starting wandb: start every rank's clock together
    train_start = window_start = time.perf_counter()
    while step < plan.total_steps:
        sampler.set_epoch(epoch)  # a new order each epoch, as with DistributedSampler
        sampler.set_start(start_batch if epoch == start_epoch else 0)  # a resumed run goes on mid-epoch
        for index, micro_batches in enumerate(loader, start=sampler.start):
            end_of_epoch = index == len(sampler.global_batches) - 1
            # One all-reduce gives the step's label tokens (counted on the host by the collator) and whether
            # any rank was asked to stop.
            agreed = torch.tensor([sum(batch["num_label_tokens"] for batch in micro_batches),
                                   stop.received is not None])
            dist.all_reduce(agreed, group=host_group)
            step_label_tokens, stopping = agreed.tolist()
            if stopping:  # preempted: checkpoint the last finished step, then exit non-zero
                path = checkpoint(epoch, next_batch=index)
                if is_main:
                    metrics.close()
                    print(f"{PROG}: stopped by {stop.name or 'a signal to another rank'} after step {step}; "
                          f"checkpoint in {path}. Resume with --resume_from_checkpoint auto", file=sys.stderr)
                sys.exit(stop.exit_code if stop.received else 1)
            learning_rate = scheduler.get_last_lr()[0]
            # A short share runs zero-weight placeholders: one, last, under DDP (its gradient all-reduce needs
            # every rank); every missing one under FSDP, whose forwards all-gather the base's shards, and under
            # DeepSpeed, which communicates in every backward. They draw no dropout masks (the RNG state is put
            # back), so the real micro-batches draw the same ones under every strategy.
            missing = args.gradient_accumulation_steps - len(micro_batches)
            if missing:
                micro_batches = [*micro_batches, *[None] * (missing if args.fsdp or args.deepspeed else 1)]
            for micro_step, batch in enumerate(micro_batches):
                last = micro_step == len(micro_batches) - 1
                # DDP all-reduces gradients once per optimizer step, on the last micro-batch.
                with (contextlib.nullcontext() if last or args.fsdp or args.deepspeed else train_model.no_sync(),
                      torch.random.fork_rng(rng_devices) if batch is None else contextlib.nullcontext()):
                    summed_loss = summed_token_loss(train_model, batch or placeholder, device)
                    if batch is None:
                        summed_loss = summed_loss * 0.0
                    backward(token_weighted_loss(summed_loss, step_label_tokens, world_size))
                if batch is not None:
                    window[0] += summed_loss.detach()
                    window[1] += batch["num_label_tokens"]
                    window[2] += batch["num_tokens"]
                    rank_tokens += batch["num_tokens"]
            if engine is not None:  # it clipped and stepped in its last micro-step
                grad_norm = engine.get_global_grad_norm()
            else:
                if args.fsdp:
                    average_gradients(parameters, world_size)
                grad_norm = clip_gradients(parameters, args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step += 1
            progress.update()
            if plan.should_log(step):
                logged = window.clone()
                dist.all_reduce(logged)  # the global loss and throughput, not rank 0's
                if is_main:
                    now = time.perf_counter()
                    metrics.write(train_record(step, plan.steps_per_epoch, logged.tolist(), learning_rate,
                                               float(grad_norm), now - window_start, now - train_start), progress)
                window.zero_()
                window_start = time.perf_counter()
            if plan.should_evaluate(step, end_of_epoch):
                eval_start = time.perf_counter()
                totals = evaluate(reft_model, eval_dataset, eval_plan[rank::world_size], collate, device,
                                  eval_forwards)
                dist.all_reduce(totals)  # every eval example counted once, weighted by its label tokens
                seconds = time.perf_counter() - eval_start
                if is_main:
                    metrics.write(eval_record(step, plan.steps_per_epoch, totals.tolist(), len(eval_dataset),
                                              seconds), progress)
                window_start += seconds  # tokens/s counts training time only
                eval_time += seconds
            if plan.should_save(step, end_of_epoch, args.save_strategy):
                checkpoint(epoch, next_batch=index + 1)
            if step == plan.total_steps:
                break
        epoch += 1
    progress.close()
    train_time = time.perf_counter() - train_start - eval_time

    # -- report: throughput and peak memory of every rank ---------------------------------------------
    peak_memory = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    per_rank = torch.tensor([rank_tokens / train_time, peak_memory, base_bytes], dtype=torch.float64,
                            device=device)
    gathered = [torch.zeros_like(per_rank) for _ in range(world_size)]
    dist.all_gather(gathered, per_rank)

    # -- output: rank 0 writes; if that fails, every rank exits with an error instead of hanging ---------
    def write_outputs() -> None:
        with storage_errors(f"writing the output to {args.output_dir}", args.output_dir):
            save_interventions(reft_model, args.output_dir)
            metrics.close()
            plot_loss(args.output_dir)
        rates = ", ".join(f"rank {r}: {t:.0f} tok/s, peak {m / 2**30:.2f} GiB, base {b / 2**20:.1f} MiB"
                          for r, (t, m, b) in enumerate(row.tolist() for row in gathered))
        print(f"Trained to step {step} in {train_time:.0f}s on {world_size} processes: "
              f"{sum(row[0].item() for row in gathered):.0f} tokens/s in all ({rates}); "
              f"{metrics.loss_summary()}. Interventions (pyreft format), arguments, metrics and loss.png in "
              f"{args.output_dir}/")
        if answers:
            print(answers)
        print(f"Done in {time.perf_counter() - started:.0f}s.")

    # A sharded base answers only with every rank taking part; a replicated one on rank 0 alone.
    answers = (sample_answers(reft_model, tokenizer, args, position, num_layers, synced_ranks=shards_base)
               if args.num_sample_answers > 0 and (is_main or shards_base) else None)
    with zero.gathered(reft_model.interventions, deepspeed_config):
        run_checked(write_outputs, participate=is_main, device=device)


def quiet_non_main_rank() -> None:
    """Ranks other than 0 print errors only: no stdout, progress bars or library warnings."""
    import logging
    import sys
    import warnings

    import datasets
    import transformers

    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)  # pyvene warns through the root logger
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def check_replicated(parameters: list, device, ddp_model=None) -> None:
    """Every trainable parameter is one DDP synchronizes (under DDP), and all ranks hold identical values."""
    import torch
    import torch.distributed as dist

    if ddp_model is not None:
        synchronized = {id(p) for module in ddp_model.module.modules() for p in module.parameters(recurse=False)
                        if p.requires_grad}
        missing = [p for p in parameters if id(p) not in synchronized]
        if missing:
            raise RuntimeError(f"{len(missing)} trainable parameters are outside the DDP module; they would diverge")
    checksum = torch.stack([p.detach().double().sum() for p in parameters]).to(device)
    lowest, highest = checksum.clone(), checksum.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    if not torch.equal(lowest, highest):
        raise RuntimeError("the interventions differ across ranks after DDP's broadcast")


if __name__ == "__main__":
    main()
