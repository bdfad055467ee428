#!/usr/bin/python3
"""The PyTorch 1.13 peer of lockstep's ZeRO benchmark: DDP (gloo) with AdamW, plain or with the
optimizer wrapped in torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO stage 1: each rank keeps
and updates the state of a greedy share of the parameters, then broadcasts them; gradients are
still all-reduced whole). Run it under a torchrun-compatible launcher (lockstep run sets RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 prints one JSON line.

    lockstep run --nproc-per-node 2 /usr/bin/python3 bench/torch_zero.py --model wide|gpt [--zero]
        [--steps 40] [--warmup 10] [--batch 64]
    lockstep run --nproc-per-node 2 PYTHON bench/torch_zero.py --deepspeed 1|2|3 ...

--deepspeed STAGE (a python with torch 2.x and deepspeed) trains the same model with DeepSpeed's
ZeRO of that stage on CPU (DS_ACCELERATOR=cpu, gloo, fp32), the same torch AdamW handed to
deepspeed.initialize and DeepSpeed's own clipping at 1.

Models: wide, the MLP 784-2048x3-10 on Fashion-MNIST-shaped inputs (the C++ side's --model wide),
AdamW with weight decay 0 (the fashion_mnist example's defaults); gpt, bench/torch_gpt.py's
default GPT on 128-byte blocks, AdamW(betas 0.9/0.99, weight decay 0.1) as examples/gpt.
Inputs are random (throughput does not depend on them; the C++ side reads the real data, which
its measurements show costs well under 1% of a step). Gradients clipped to norm 1 on both sides.
"""
import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402  (the same GPT as the GPT comparison)


def wide_model():
    layers, width = [torch.nn.Flatten()], 784
    for _ in range(3):
        layers += [torch.nn.Linear(width, 2048), torch.nn.ReLU()]
        width = 2048
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def pss_bytes():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def state_bytes(optimizer):
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    inner = getattr(inner, "optimizer", inner)  # DeepSpeed's ZeRO optimizers wrap the torch one
    return sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


def deepspeed_engine(model, opt_args, batch, stage):
    """DeepSpeed's ZeRO at `stage` around `model`, in fp32, with a torch AdamW of `opt_args`."""
    import deepspeed
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), **opt_args),
                                             config=config)
    return engine, opt


def deepspeed_version():
    import deepspeed
    return deepspeed.__version__


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["wide", "gpt"], default="wide")
    ap.add_argument("--zero", action="store_true", help="wrap AdamW in ZeroRedundancyOptimizer")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=0, help="per worker (0: 64 for wide, 16 for gpt)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--deepspeed", type=int, choices=[1, 2, 3], help="DeepSpeed ZeRO of this stage instead of DDP")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed looks for a GPU
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    if args.model == "wide":
        model, batch = wide_model(), args.batch or 64
        opt_args = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
        gen = torch.Generator().manual_seed(rank)
        data = [(torch.randn(batch, 1, 28, 28, generator=gen), torch.randint(10, (batch,), generator=gen))
                for _ in range(8)]
        loss_of = F.cross_entropy
        per_sample = 1
    else:
        config = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256, "dropout": 0.1}
        model, batch = torch_gpt.GptLmHeadModel(config), args.batch or 16
        opt_args = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
        gen = torch.Generator().manual_seed(rank)
        data = []
        for _ in range(8):
            block = torch.randint(256, (batch, 129), generator=gen)
            data.append((block[:, :-1], block[:, 1:]))
        loss_of = lambda logits, y: F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))  # noqa: E731
        per_sample = 128
    if args.deepspeed:
        net, opt = deepspeed_engine(model, opt_args, batch, args.deepspeed)
    else:
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    if args.zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **opt_args)
    elif not args.deepspeed:
        opt = torch.optim.AdamW(model.parameters(), **opt_args)
    torch.manual_seed(42 + rank)

    start, timed = None, 0
    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        x, y = data[step % len(data)]
        loss = loss_of(net(x), y)
        if args.deepspeed:
            net.backward(loss)  # the engine reduces (and partitions) the gradients, clips, steps
            net.step()
        else:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        timed += start is not None
    dist.barrier()
    elapsed = time.perf_counter() - start

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    totals = torch.tensor([pss_bytes(), state_bytes(opt), rss], dtype=torch.float64)
    dist.all_reduce(totals)
    if rank == 0:
        samples = batch * world * timed
        # DeepSpeed keeps its own fp32 partitions and (stage 3) empties the parameters: its state
        # is not the tensors counted here, so only its PSS is reported.
        params = None if args.deepspeed else sum(p.numel() * p.element_size() for p in model.parameters())
        print(json.dumps({
            "side": "deepspeed" if args.deepspeed else "pytorch", "model": args.model, "zero": args.zero,
            "deepspeed_stage": args.deepspeed, "world": world, "batch": batch,
            "samples_per_s": samples / elapsed, "tokens_per_s": samples * per_sample / elapsed if per_sample > 1 else None,
            "step_s": elapsed / timed, "peak_rss_bytes": rss, "job_peak_rss_bytes": totals[2].item(),
            "job_pss_bytes": totals[0].item(), "job_optimizer_state_bytes": totals[1].item(),
            "job_parameter_bytes": params and params * world, "threads": args.threads, "torch": torch.__version__,
            "deepspeed": deepspeed_version() if args.deepspeed else None}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
