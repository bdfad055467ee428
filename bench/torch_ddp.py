#!/usr/bin/python3
"""The PyTorch peer of ddp_bench: the same model, batch, optimizer and JSON line, on Debian's
python3-torch. Alone it trains one process; under a torchrun-compatible launcher (lockstep run
or torchrun) it uses torch.nn.parallel.DistributedDataParallel over --backend (gloo by default;
"lockstep" is lockstep's torch.distributed backend, registered when lockstep_torch is installed
or PYTHONPATH holds <build>/python: the script itself imports nothing for it).

    /usr/bin/python3 bench/torch_ddp.py --model mlp|wide|cnn [--batch 64] [--steps N] [--no-sync]
                                        [--backend gloo|lockstep] [--compile] [--gradient-as-bucket-view]

It runs on torch 1.13 and 2.x alike; --compile (2.x) trains torch.compile(model), compiled during
the warm-up steps. --gradient-as-bucket-view passes DDP's option of that name: the gradients are
views into DDP's buckets instead of tensors DDP copies into them before the all-reduce and back
after it. The JSON line names the torch and its BLAS.
"""
import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist


def build(model):
    if model == "cnn":  # the Fashion-MNIST example's CNN, as in ddp_bench
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 7 * 7, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    widths = {"mlp": [784, 1024, 1024, 10], "wide": [784, 2048, 2048, 2048, 10]}[model]
    layers = [torch.nn.Flatten()]
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def blas_of_torch():
    """The BLAS this torch multiplies with, as its build configuration names it."""
    for part in torch.__config__.show().replace("\n", ",").split(","):
        if "BLAS_INFO=" in part:
            return part.split("=", 1)[1].strip()
    return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-cap-mb", type=float, default=25)
    ap.add_argument("--no-sync", action="store_true")
    ap.add_argument("--backend", default="gloo", help="torch.distributed backend under a launcher")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (torch 2.x)")
    ap.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP's option of that name")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    model = build(args.model)
    rank, world, ddp = 0, 1, None
    if "RANK" in os.environ:
        dist.init_process_group(args.backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb,
                                                        gradient_as_bucket_view=args.gradient_as_bucket_view)
    net = ddp if ddp is not None else model
    if args.compile:
        net = torch.compile(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(100 + rank)
    pool = [(torch.rand(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))) for _ in range(8)]

    fwd = bwd = optim = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if ddp is not None:
                dist.barrier()
            start = time.perf_counter()
            fwd = bwd = optim = 0.0
        x, y = pool[step % len(pool)]
        ctx = ddp.no_sync() if (ddp is not None and args.no_sync) else contextlib.nullcontext()
        with ctx:
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            t1 = time.perf_counter()
            opt.zero_grad()
            loss.backward()
            t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        fwd += t1 - t0
        bwd += t2 - t1
        optim += t3 - t2
    if ddp is not None:
        dist.barrier()
    elapsed = time.perf_counter() - start
    if rank == 0:
        n = args.steps
        print(json.dumps({"model": args.model, "world": world, "batch": args.batch, "threads": args.threads,
                          "backend": args.backend if ddp is not None else None,
                          "ddp": ddp is not None, "no_sync": args.no_sync, "compiled": args.compile,
                          "gradient_as_bucket_view": args.gradient_as_bucket_view,
                          "torch": torch.__version__, "torch_blas": blas_of_torch(), "bucket_cap_mb": args.bucket_cap_mb,
                          "samples_per_s": round(args.batch * world * n / elapsed, 1), "step_s": elapsed / n,
                          "forward_s": fwd / n, "backward_s": bwd / n, "optimizer_s": optim / n}), flush=True)
    if ddp is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
