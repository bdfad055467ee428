#!/usr/bin/python3
"""The PyTorch peer of `examples/gpt --pipeline-parallel P`: the same byte-level GPT (bench/torch_gpt.py's
model, data and initialisation) cut into P stages with torch.distributed.pipelining, one stage per
process, trained under one of its schedules over gloo. The last rank prints one JSON line.

    lockstep run --nproc-per-node P PYTHON bench/torch_pipeline.py --schedule 1f1b --microbatches 8
        [--micro-batch 2] [--steps 30] [--warmup 10] [--n-layer 4 --n-head 4 --n-embd 256 --block-size 128]
        [--split 2,2]

Stages: the embeddings and the first blocks, ..., the last blocks, the final LayerNorm and the
head. torch's pipelining keeps no parameter on two stages, so the last stage's head has its own
copy of the token embedding (untied), and no gradient crosses for it: less traffic than lockstep's
tied head, which sends its gradient to the first stage every micro-batch. Each step: m micro-batches
of --micro-batch blocks, AdamW (fused), no clipping (torch's pipelining has none across stages;
the lockstep side runs with --max-grad-norm 0 in the comparison). torch 2.4 or later.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402


class FirstStage(torch.nn.Module):
    def __init__(self, model, blocks):
        super().__init__()
        self.wte, self.wpe, self.drop = model.transformer.wte, model.transformer.wpe, model.transformer.drop
        self.h = torch.nn.ModuleList(blocks)

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))
        for block in self.h:
            x = block(x)
        return x


class MiddleStage(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.h = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x


class LastStage(torch.nn.Module):
    def __init__(self, model, blocks):
        super().__init__()
        self.h = torch.nn.ModuleList(blocks)
        self.ln_f = model.transformer.ln_f
        self.head = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())  # untied copy

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.head)


def stage_module(model, rank, world, split):
    blocks = list(model.transformer.h)
    bounds = [0]
    for n in split:
        bounds.append(bounds[-1] + n)
    mine = blocks[bounds[rank]:bounds[rank + 1]]
    if rank == 0:
        return FirstStage(model, mine)
    if rank == world - 1:
        return LastStage(model, mine)
    return MiddleStage(mine)


def schedule_of(name, stage, m, loss_fn):
    from torch.distributed import pipelining as pp
    kinds = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}
    if name not in kinds:
        raise SystemExit(f"--schedule {name}: this peer runs gpipe and 1f1b (one stage per rank)")
    return kinds[name](stage, n_microbatches=m, loss_fn=loss_fn)


def peer_arguments():
    """The flags every pipeline peer takes (this one and bench/deepspeed_pipeline.py): the step's
    micro-batches, how long to run, the GPT's shape, the corpus."""
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--corpus-dir", default="/usr/share/games/fortunes")
    return p


def main():
    p = peer_arguments()
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--split", default="", help="blocks per stage (default: as even as can be)")
    args = p.parse_args()
    from torch.distributed.pipelining import PipelineStage

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(42)
    config = {"vocab_size": torch_gpt.VOCAB, "block_size": args.block_size, "n_layer": args.n_layer,
              "n_head": args.n_head, "n_embd": args.n_embd, "dropout": 0.0}
    model = torch_gpt.GptLmHeadModel(config)
    split = [int(n) for n in args.split.split(",")] if args.split else \
        [args.n_layer // world + (1 if r < args.n_layer % world else 0) for r in range(world)]
    module = stage_module(model, rank, world, split)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))

    def loss_fn(logits, target):
        return F.cross_entropy(logits.float().reshape(-1, torch_gpt.VOCAB), target.reshape(-1))

    schedule = schedule_of(args.schedule, stage, args.microbatches, loss_fn)
    module = stage.submod  # what the stage runs (it may hold its own copy of the module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1,
                            fused=hasattr(torch.optim.AdamW, "_step_supports_amp_scaling"))
    _, train_stream, _ = torch_gpt.load_corpus(args.corpus_dir)
    data = torch_gpt.TokenBlocks(train_stream, args.block_size)
    batch = args.microbatches * args.micro_batch
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42))
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        blocks = torch.stack([data[int(i)] for i in order[step * batch:(step + 1) * batch]])
        x, y = blocks[:, :-1], blocks[:, 1:]
        begin = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        step_losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=step_losses)
        else:
            schedule.step()
        opt.step()
        dist.barrier()  # the step ends when every stage's does, as lockstep's (its norm all-reduce)
        if step >= args.warmup:
            times.append(time.perf_counter() - begin)
        if step_losses:
            losses.append(torch.stack(step_losses).mean().item())
    if rank == world - 1:
        step_s = sum(times) / len(times)
        print(json.dumps({"side": "torch.distributed.pipelining", "torch": torch.__version__, "schedule": args.schedule,
                          "stages": world, "microbatches": args.microbatches, "micro_batch": args.micro_batch,
                          "step_s": step_s, "tokens_per_s": batch * args.block_size / step_s,
                          "first_loss": losses[0], "last_loss": losses[-1],
                          "loss_is_finite": all(math.isfinite(v) for v in losses)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
