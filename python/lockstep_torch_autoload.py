"""Registers lockstep's torch.distributed backend in programs that never import lockstep_torch.

lockstep_torch_autoload.pth (installed next to this file) or the build tree's sitecustomize.py
call install() when the interpreter starts. That costs nothing until the program imports
torch.distributed: right after that module has loaded, lockstep_torch is imported and
registers the name "lockstep", so `dist.init_process_group("lockstep")` works unmodified.
This module imports no torch itself.
"""
import importlib.abc
import sys

_TARGET = "torch.distributed"


def _register(distributed):
    if not distributed.is_available():
        return
    try:
        import lockstep_torch  # noqa: F401  (registers on import)
    except Exception as error:  # the user must still get a working torch.distributed
        _register_broken(distributed, error)


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


class _RegisterAfterLoad(importlib.abc.Loader):
    """The loader of torch.distributed, registering lockstep once the module has executed."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ... for inspect and friends
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Asks the other finders for torch.distributed and wraps the loader they return."""

    lockstep_autoload = True

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RegisterAfterLoad(spec.loader)
            return spec
        return None


def install():
    """Arranges the registration; a second call (a .pth and a sitecustomize both) does nothing."""
    if any(getattr(f, "lockstep_autoload", False) for f in sys.meta_path):
        return
    if _TARGET in sys.modules:  # already imported: register now
        _register(sys.modules[_TARGET])
        return
    sys.meta_path.insert(0, _Finder())
