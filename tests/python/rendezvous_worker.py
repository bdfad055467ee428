"""One rank of test_rendezvous.py: joins a lockstep group the way MODE says, all-reduces once,
and prints {"rank", "sum", "comm_backend"}.

    rendezvous_worker.py MODE RANK WORLD ADDRESS
    MODE: file (ADDRESS: a path), tcp (ADDRESS: host:port), store (a TCPStore at host:port)
"""
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import lockstep_torch


def main():
    mode, rank, world, address = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    timeout = timedelta(seconds=60)
    if mode == "file":
        dist.init_process_group("lockstep", init_method=f"file://{address}", rank=rank, world_size=world,
                                timeout=timeout)
    elif mode == "tcp":
        dist.init_process_group("lockstep", init_method=f"tcp://{address}", rank=rank, world_size=world,
                                timeout=timeout)
    else:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world, rank == 0, timeout)
        dist.init_process_group("lockstep", store=store, rank=rank, world_size=world, timeout=timeout)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    print(json.dumps({"rank": rank, "sum": t[0].item(),
                      "comm_backend": lockstep_torch.group_backend().comm_backend}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
