"""One replica group of a torchft job: the worker bench/compare_elastic.py's torchft part starts
with PyTorch 2.x's torchrun on each machine (one process per replica group), beside a
torchft_lighthouse. The job is the MLP of the lockstep side (784-512-256-10), batch 64 per
replica, AdamW lr 1e-3, one intra-op thread, random data (seeded per replica: the time a failure
costs does not depend on them). torchft's way: every step asks the lighthouse for a quorum of
live replica groups, all-reduces the gradients among them over its own gloo group (torchft's
DistributedDataParallel hook) and commits the step only where every participant succeeded; a
failed step is dropped and the survivors go on without the dead replica.

After every committed step it prints "step N/MAX participants P", which the benchmark timestamps.

    REPLICA_GROUP_ID=m TORCHFT_LIGHTHOUSE=http://HOST:29510 \\
        torchrun --nnodes 1 --nproc_per_node 1 bench/torchft_worker.py [--max-steps 400]
"""
import argparse
import os
import socket
from datetime import timedelta

import torch
import torch.nn.functional as F
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.optim import OptimizerWrapper


class AddressedTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport, which a healing replica fetches the weights from,
    advertising `host` instead of this machine's hostname (which network namespaces do not resolve)."""

    def __init__(self, host, timeout):
        self.host = host  # first: the base class's constructor already asks for the address
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self):
        return f"http://{self.host}:{self._server.socket.getsockname()[1]}/checkpoint/"


def mlp():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds: torchft's collective and quorum timeout")
    ap.add_argument("--hostname", default=socket.gethostname(), help="the address the other replicas reach this one at")
    args = ap.parse_args()
    torch.set_num_threads(1)
    replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    torch.manual_seed(42)  # every replica starts from the same weights (so no sync on step 0)
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=1, replica_id=f"replica_{replica}", hostname=args.hostname,
                      timeout=timeout, quorum_timeout=timeout, init_sync=False,
                      checkpoint_transport=AddressedTransport(args.hostname, timeout))
    net = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, inner)
    gen = torch.Generator().manual_seed(replica)
    data = [(torch.randn(64, 1, 28, 28, generator=gen), torch.randint(10, (64,), generator=gen)) for _ in range(8)]
    while manager.current_step() < args.max_steps:
        x, y = data[manager.current_step() % len(data)]
        opt.zero_grad()  # starts the quorum for this step
        loss = F.cross_entropy(net(x), y)
        loss.backward()  # the gradients' all-reduce among the quorum's replicas
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # commits only when every participant's step succeeded
        print(f"step {manager.current_step()}/{args.max_steps} participants {manager.num_participants()} "
              f"loss {loss.item():.4f}", flush=True)
    manager.shutdown(wait=False)
    os._exit(0)  # the manager's threads may still wait on a dead peer


if __name__ == "__main__":
    main()
