"""The build tree's start-up hook: PYTHONPATH=<build>/python makes every Python program there
register lockstep's torch.distributed backend when it imports torch.distributed (an installed
lockstep_torch does the same through its .pth file; this file is not installed).

Python imports only the first sitecustomize on sys.path, so this one runs the one it hides
(Debian's installs apport's exception hook) after arranging the registration.
"""
import importlib.machinery
import importlib.util
import os
import sys

import lockstep_torch_autoload

lockstep_torch_autoload.install()


def _run_hidden_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_run_hidden_sitecustomize()
