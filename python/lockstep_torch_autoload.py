"""Registers lockstep's torch.distributed backend in programs that never import lockstep_torch.

Two ways in, one per torch generation:
- torch >= 2.5 loads the packages of its "torch.backends" entry-point group as `import torch`
  ends: lockstep_torch's (pyproject.toml; the build tree has the same in its dist-info) calls
  torch_backends_entry().
- torch 1.13 has no such group: lockstep_torch_autoload.pth (installed for torch < 2.5) or the build
  tree's sitecustomize.py calls install() when the interpreter starts. That costs nothing until the
  program imports torch.distributed; right after that module has loaded, lockstep_torch is imported,
  and once torch itself has loaded (it imports torch.distributed halfway), the group is made.
Either way the name "lockstep" is registered, so `dist.init_process_group("lockstep")` works
unmodified, and, when LOCKSTEP_TORCH_BACKEND names a backend (`lockstep run --torch-backend`), the
default process group is created with it, so that a script which leaves that to the Hugging Face
Trainer or Accelerate (they create one only when none exists) runs on it unchanged.
A lockstep_torch that fails to load never breaks `import torch`. This module imports no torch itself.
"""
import importlib.abc
import os
import sys

_CREATE_WITH = "LOCKSTEP_TORCH_BACKEND"


def torch_backends_entry():
    """torch's "torch.backends" entry point (torch >= 2.5), called as `import torch` ends."""
    import torch.distributed as distributed

    _register(distributed)
    _create_default_group(distributed)


def _entry_point_runs():
    """Whether torch will call torch_backends_entry itself: from 2.5 on, unless switched off, where
    lockstep_torch's metadata (an installed one's, or the build tree's) declares the entry point."""
    version = getattr(sys.modules.get("torch.version"), "__version__", "0.0")
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    if (major, minor) < (2, 5) or os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
        return False
    from importlib.metadata import entry_points

    return any(e.value == f"{__name__}:torch_backends_entry" for e in entry_points(group="torch.backends"))


def _create_default_group(distributed):
    """The default process group on LOCKSTEP_TORCH_BACKEND's backend, when set and none exists yet,
    in a worker: a process with torchrun's RANK and WORLD_SIZE (not torchrun's own agent, which
    imports torch with the same environment). Asked for, its failure is an error, not a silent
    fall back to another backend."""
    backend = os.environ.get(_CREATE_WITH)
    if not backend or not distributed.is_available() or distributed.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    try:
        distributed.init_process_group(backend=backend)
    except Exception as error:
        raise RuntimeError(f"lockstep: {_CREATE_WITH}={backend} (lockstep run --torch-backend) asks for the default "
                           f"process group, and creating it failed: {type(error).__name__}: {error}") from error


def _register(distributed):
    if not distributed.is_available():
        return
    try:
        import lockstep_torch  # noqa: F401  (registers on import)
    except Exception as error:  # the user must still get a working torch.distributed
        _register_broken(distributed, error)


def _after_torch(_torch):
    """The import hook's work once torch has loaded whole: the group, unless torch's entry point
    (torch >= 2.5) makes it."""
    if os.environ.get(_CREATE_WITH) and not _entry_point_runs():
        import torch.distributed as distributed

        _create_default_group(distributed)


def _register_broken(distributed, error):
    """A creator that explains, when "lockstep" is asked for, why the backend could not load."""
    message = f"lockstep: the lockstep_torch extension failed to load: {type(error).__name__}: {error}"

    def create(*_args, **_kwargs):
        raise RuntimeError(message)

    if hasattr(distributed.Backend, "LOCKSTEP"):
        return
    try:  # torch 2.x asks for the devices; without them it consults torch.accelerator, which may not be
        # loaded yet (torch.distributed is imported while torch itself initialises)
        distributed.Backend.register_backend("lockstep", create, extended_api=True, devices=["cpu"])
    except TypeError:  # torch 1.x
        distributed.Backend.register_backend("lockstep", create, extended_api=True)
    except Exception:  # nothing here may break `import torch` for a program that never asks for lockstep
        pass


# What runs right after each module has executed: lockstep registers once torch.distributed exists
# (torch imports it halfway through its own initialisation), the group waits for torch whole.
_AFTER_LOAD = {"torch.distributed": _register, "torch": _after_torch}


class _RunAfterLoad(importlib.abc.Loader):
    """A module's loader, calling `after(module)` once the module has executed."""

    def __init__(self, loader, after):
        self._loader = loader
        self._after = after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ... for inspect and friends
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Asks the other finders for torch and torch.distributed and wraps the loaders they return."""

    lockstep_autoload = True

    def find_spec(self, fullname, path, target=None):
        after = _AFTER_LOAD.get(fullname)
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RunAfterLoad(spec.loader, after)
            return spec
        return None


def install():
    """Arranges the registration; a second call (a .pth and a sitecustomize both) does nothing."""
    if any(getattr(f, "lockstep_autoload", False) for f in sys.meta_path):
        return
    if "torch.distributed" in sys.modules:  # already imported: do now what the hook would have done
        _register(sys.modules["torch.distributed"])
        if "torch" in sys.modules:
            _after_torch(sys.modules["torch"])
        return
    sys.meta_path.insert(0, _Finder())
