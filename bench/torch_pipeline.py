#!/usr/bin/python3
"""The PyTorch peer of `examples/gpt --pipeline-parallel P`: the same byte-level GPT (bench/torch_gpt.py's
model, data and initialisation) cut into stages with torch.distributed.pipelining, trained under
one of its schedules over gloo. The rank holding the last stage prints one JSON line.

    lockstep run --nproc-per-node P PYTHON bench/torch_pipeline.py --schedule 1f1b --microbatches 8
        [--micro-batch 2] [--steps 30] [--warmup 10] [--n-layer 4 --n-head 4 --n-embd 256 --block-size 128]
        [--split 2,2]

Schedules: gpipe and 1f1b (one stage per rank), interleaved-1f1b and interleaved-zb (two stages per
rank, rank r holding stages r and r + P, as lockstep's --virtual-stages 2 places them), zbv (two
stages per rank in a V: rank r holds r and 2P - 1 - r). --split gives the blocks of each of the
P x v stages (default: as even as can be).

Stages: the embeddings and the first blocks, ..., the last blocks, the final LayerNorm and the
head. torch's pipelining keeps no parameter on two ranks, so where the first and last stages are on
different ranks the last stage's head has its own copy of the token embedding (untied), and no
gradient crosses for it: less traffic than lockstep's tied head, which sends its gradient to the
first stage every micro-batch. Under zbv both are on rank 0 and share the one weight (tied, as
lockstep's). Each step: m micro-batches of --micro-batch blocks, AdamW (fused), no clipping
(torch's pipelining has none across stages; the lockstep side runs with --max-grad-norm 0 in the
comparison). A step's time includes cutting its micro-batches from the corpus, as lockstep's
includes its data loader's. torch 2.4 or later (the interleaved and V schedules: 2.6).
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
    def __init__(self, model, blocks, tied):
        super().__init__()
        self.h = torch.nn.ModuleList(blocks)
        self.ln_f = model.transformer.ln_f
        # The embedding's own weight where the first stage is in this process, else an untied copy.
        self.head = model.transformer.wte.weight if tied else \
            torch.nn.Parameter(model.transformer.wte.weight.detach().clone())

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.head)


SCHEDULES = {  # name: (torch's class, stages per rank, placement)
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
}


def stages_of(rank, world, chunks, placement):
    """The stage indices rank `rank` holds."""
    if placement == "v":
        return [rank, 2 * world - 1 - rank]
    return [c * world + rank for c in range(chunks)]


def stage_module(model, stage, stages, split, tied):
    blocks = list(model.transformer.h)
    bounds = [0]
    for n in split:
        bounds.append(bounds[-1] + n)
    mine = blocks[bounds[stage]:bounds[stage + 1]]
    if stage == 0:
        return FirstStage(model, mine)
    if stage == stages - 1:
        return LastStage(model, mine, tied)
    return MiddleStage(mine)


def schedule_of(name, stages, m, loss_fn):
    from torch.distributed import pipelining as pp
    cls = getattr(pp, SCHEDULES[name][0])
    return cls(stages[0] if len(stages) == 1 else stages, n_microbatches=m, loss_fn=loss_fn)


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
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
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
    _, chunks, placement = SCHEDULES[args.schedule]
    count = world * chunks
    split = [int(n) for n in args.split.split(",")] if args.split else \
        [args.n_layer // count + (1 if s < args.n_layer % count else 0) for s in range(count)]
    if len(split) != count or sum(split) != args.n_layer:
        raise SystemExit(f"--split {args.split}: {count} stages of {args.n_layer} blocks in all")
    held = stages_of(rank, world, chunks, placement)
    tied = 0 in held and count - 1 in held
    modules = [stage_module(model, s, count, split, tied) for s in held]
    stages = [PipelineStage(mod, s, count, torch.device("cpu")) for mod, s in zip(modules, held)]
    if tied and stages[0].submod.wte.weight is not stages[-1].submod.head:
        raise SystemExit("the tied head lost its weight to a copy: the comparison would not be tied")

    def loss_fn(logits, target):
        return F.cross_entropy(logits.float().reshape(-1, torch_gpt.VOCAB), target.reshape(-1))

    schedule = schedule_of(args.schedule, stages, args.microbatches, loss_fn)
    params = list({id(t): t for st in stages for t in st.submod.parameters()}.values())  # a tied weight once
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1,
                            fused=hasattr(torch.optim.AdamW, "_step_supports_amp_scaling"))
    _, train_stream, _ = torch_gpt.load_corpus(args.corpus_dir)
    data = torch_gpt.TokenBlocks(train_stream, args.block_size)
    batch = args.microbatches * args.micro_batch
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42))
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        begin = time.perf_counter()
        blocks = torch.stack([data[int(i)] for i in order[step * batch:(step + 1) * batch]])
        x, y = blocks[:, :-1], blocks[:, 1:]
        opt.zero_grad(set_to_none=True)
        step_losses = []
        inputs = [x] if 0 in held else []
        targets = {"target": y, "losses": step_losses} if count - 1 in held else {}
        schedule.step(*inputs, **targets)
        opt.step()
        dist.barrier()  # the step ends when every stage's does, as lockstep's (its norm all-reduce)
        if step >= args.warmup:
            times.append(time.perf_counter() - begin)
        if step_losses:
            losses.append(torch.stack(step_losses).mean().item())
    if count - 1 in held:
        step_s = sum(times) / len(times)
        print(json.dumps({"side": "torch.distributed.pipelining", "torch": torch.__version__, "schedule": args.schedule,
                          "stages": count, "split": split, "microbatches": args.microbatches, "micro_batch": args.micro_batch,
                          "step_s": step_s, "tokens_per_s": batch * args.block_size / step_s,
                          "first_loss": losses[0], "last_loss": losses[-1],
                          "loss_is_finite": all(math.isfinite(v) for v in losses)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
