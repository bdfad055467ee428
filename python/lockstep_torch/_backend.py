"""The creator torch.distributed calls for a group on the lockstep backend, and its registration."""
import atexit
import functools
import sys

import torch
import torch.distributed as dist

from . import _build


def _check_torch():
    """The extension links one libtorch: loaded into another torch it would crash the process,
    so a mismatch is an ImportError naming both and the python to use."""
    if torch.__version__ != _build.TORCH_VERSION:
        raise ImportError(f"lockstep_torch was built for torch {_build.TORCH_VERSION} (the python at "
                          f"{_build.PYTHON}), but this python ({sys.executable}) has torch {torch.__version__}: "
                          f"run the program with {_build.PYTHON}, or build lockstep for this torch")


_check_torch()
try:
    from . import _C  # noqa: E402  (only once the torch is known to be the one it links)
except ImportError as error:  # a system library missing on this machine: name what installs it
    import lockstep_torch_runtime

    raise ImportError(lockstep_torch_runtime.explain(error)) from error

BACKEND_NAME = "lockstep"
ProcessGroupLockstep = _C.ProcessGroupLockstep


def available_backends():
    """lockstep's transports built into this extension, e.g. ['shm', 'gloo', 'hier', 'mpi']."""
    return _C.available_backends()


def group_backend(group=None):
    """The lockstep group under a torch.distributed group (default: the world), whatever torch's
    generation: torch 1.x's group is the ProcessGroupLockstep itself, torch 2.x's dispatches its CPU
    tensors to one."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(pg, ProcessGroupLockstep):
        return pg
    backend = pg._get_backend(torch.device("cpu")) if _C.backend_api else None
    if not isinstance(backend, ProcessGroupLockstep):
        raise ValueError(f"lockstep: the group runs on {dist.get_backend(pg)}, not on lockstep")
    return backend


def _seconds(timeout):
    return timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)


def _create_process_group(options, pg_options=None):
    """torch's extended creator API: `options` is a _DistributedBackendOptions."""
    if pg_options is not None:
        raise ValueError("lockstep: the backend takes no pg_options; it is configured by LOCKSTEP_* environment "
                         "variables (see `lockstep env`)")
    return _C.create_process_group(options.store, options.group_rank, options.group_size,
                                   _seconds(options.timeout), options.group_id,
                                   list(options.global_ranks_in_group))


def _let_monitored_barrier_reach_lockstep():
    """torch 1.x's torch.distributed.monitored_barrier refuses every backend but gloo in Python, before the
    group's own monitored_barrier (which lockstep implements) is asked. On a lockstep group this
    wrapper asks the group; on any other it is torch's function, unchanged."""
    original = dist.monitored_barrier

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        if dist.distributed_c10d._rank_not_in_group(group) or dist.get_backend(group) != BACKEND_NAME:
            return original(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return pg.monitored_barrier(timeout if timeout is not None else dist.distributed_c10d.default_pg_timeout,
                                    wait_all_ranks=wait_all_ranks)

    dist.monitored_barrier = monitored_barrier


def register():
    """Registers "lockstep" with torch.distributed; a second call does nothing."""
    if not dist.is_available():
        raise RuntimeError("lockstep: this torch was built without torch.distributed")
    if hasattr(dist.Backend, BACKEND_NAME.upper()):
        return
    if _C.backend_api:
        # torch 2.x: the group is a c10d.Backend for CPU tensors, which a ProcessGroup dispatches to
        # ("lockstep" and "cpu:lockstep" alike); its monitored_barrier asks any CPU backend.
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True, devices=["cpu"])
    else:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True)
        _let_monitored_barrier_reach_lockstep()
    # Before the interpreter finalizes, let every group finish completing its collectives: a
    # completion thread that drops a Python callback afterwards would abort the process.
    atexit.register(_C.quiesce)
