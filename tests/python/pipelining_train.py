#!/usr/bin/python3
"""PyTorch's own pipeline parallelism (torch.distributed.pipelining) on a backend: a small MLP cut
into two stages, one per rank, trained under Schedule1F1B (4 micro-batches) with SGD for a few
steps. Rank 1 (the last stage) writes its per-step losses, every rank its stage's parameters.

    pipelining_train.py BACKEND OUT_PREFIX   (under torchrun's or lockstep run's environment)
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import lockstep_torch  # noqa: F401  registers the "lockstep" backend


def stages():
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh())
    last = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return [first, last]


def main():
    backend, out = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.set_num_threads(1)
    module = stages()[rank]
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    loss_fn = torch.nn.CrossEntropyLoss()
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    module = stage.submod  # what the stage runs (it may hold its own copy of the module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(16, 16, generator=data)  # one batch, learnt over the steps
    y = torch.randint(0, 4, (16,), generator=data)
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            step_losses = []
            schedule.step(target=y, losses=step_losses)
            losses.append(torch.stack(step_losses).detach())
        optimizer.step()
    torch.save({"backend": backend, "losses": losses, "state": module.state_dict()}, f"{out}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
