"""lockstep as a torch.distributed backend.

    import torch.distributed as dist
    dist.init_process_group("lockstep")   # then DDP, ZeroRedundancyOptimizer, comm hooks, ...

Importing this package registers the backend name "lockstep" with torch.distributed. Programs
need not import it: where lockstep_torch is installed (its .pth file), or under
PYTHONPATH=<build>/python, it is registered as soon as a program imports torch.distributed.

The group rendezvous through what init_process_group was given (env:// with torchrun's RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT, tcp://, file://, or a store) and, under `lockstep run`,
through the launcher's store. LOCKSTEP_BACKEND picks lockstep's transport
(auto, shm, gloo, hier, mpi, nccl); see docs/python.md for what is supported.
"""
from ._backend import BACKEND_NAME, ProcessGroupLockstep, available_backends, group_backend, register

register()

__all__ = ["BACKEND_NAME", "ProcessGroupLockstep", "available_backends", "group_backend", "register"]
