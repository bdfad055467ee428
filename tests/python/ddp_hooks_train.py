#!/usr/bin/python3
"""PyTorch DDP with a communication hook, or with ZeroRedundancyOptimizer: the stock ones from
torch.distributed.algorithms and torch.distributed.optim, nothing lockstep-specific. The one
exception is bf16: torch 1.13 refuses its stock bf16_compress_hook without CUDA and NCCL (a check
in DistributedDataParallel, not in the hook), so --hook bf16 registers the same three steps
written here (cast the bucket to bfloat16, all-reduce it asynchronously, divide and cast back in
the future's callback). Every rank saves its final parameters and losses to OUT_DIR/rank<N>.pt.

    ddp_hooks_train.py BACKEND OUT_DIR --hook none|fp16|bf16|powersgd [--zero] [--steps N]
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def bf16_hook(process_group, bucket):
    """What torch's bf16_compress_hook does, under a name DDP's CUDA-only check lets through."""
    group = process_group if process_group is not None else dist.group.WORLD
    world = group.size()
    compressed = bucket.buffer().to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        out = bucket.buffer()
        out.copy_(fut.value()[0])
        return out

    return fut.then(decompress)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("out_dir")
    ap.add_argument("--hook", default="none", choices=["none", "fp16", "bf16", "powersgd"])
    ap.add_argument("--zero", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    # Several buckets, except under PowerSGD: its hook issues each bucket's second and third
    # all_reduce from the first one's completion callback, which on a CPU backend runs on the
    # backend's thread while autograd issues the next bucket's, so the ranks' orders can differ
    # (gloo then hangs; lockstep raises naming the mismatch). One bucket has no such race.
    ddp = DDP(model, bucket_cap_mb=25 if args.hook == "powersgd" else 0.05)
    if args.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif args.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=3, min_compression_rate=0.5,
                                            random_seed=11)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    if args.zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    # A learnable target: a fixed random linear teacher, the same on every rank.
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
    data = torch.Generator().manual_seed(500 + rank)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        y = (x @ teacher).argmax(1)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if args.zero:
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            assert len(opt.state_dict()["state"]) == len(list(model.parameters()))
    torch.save({"state": model.state_dict(), "losses": losses}, os.path.join(args.out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
