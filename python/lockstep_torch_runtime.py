"""The system libraries a pip-installed lockstep_torch loads, and the `lockstep` console script.

A wheel (`pip wheel`) is built on one machine and installed on others. As it is made, it records
each shared library its extension and launcher load from the system, with the Debian package that
held it there (lockstep_torch/runtime-libraries.txt, written by python/cmake/runtime_packages.cmake),
so that a machine lacking one is told the command to run, by `import lockstep_torch` and by
`lockstep`. The build tree and `cmake --install` have no such record: they run where they were built.

This module sits beside the package, not in it, and imports no torch: the console script starts
the launcher without loading torch into it.
"""
import ctypes
import os
import sys

_PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lockstep_torch")


def libraries():
    """[(soname, Debian package or "-")] as recorded when the wheel was built; [] without a record."""
    try:
        with open(os.path.join(_PACKAGE, "runtime-libraries.txt"), encoding="utf-8") as listing:
            return [tuple(line.split()[:2]) for line in listing if len(line.split()) >= 2]
    except OSError:
        return []


def install_hint(sonames=None):
    """'apt-get install ...' for the recorded packages of `sonames` (default: all of them), or ''."""
    packages = sorted({package for soname, package in libraries()
                       if package != "-" and (sonames is None or soname in sonames)})
    return f"apt-get install {' '.join(packages)}" if packages else ""


def explain(error):
    """An ImportError's text, with the command that installs the system libraries when one is missing."""
    text = str(error)
    if "cannot open shared object file" not in text:
        return text
    hint = install_hint()
    if hint:
        return f"{text}\nlockstep_torch needs these Debian packages at run time: {hint}"
    return f"{text}\nlockstep_torch was built against a system library this machine lacks: install the package that holds it"


def missing():
    """The recorded libraries this machine cannot load."""
    absent = []
    for soname, _package in libraries():
        try:
            ctypes.CDLL(soname)
        except OSError:
            absent.append(soname)
    return absent


def launch():
    """The `lockstep` console script: the launcher built into the package, run in this process once
    the libraries it loads are known to be there (else the command that installs them)."""
    launcher = os.path.join(_PACKAGE, "bin", "lockstep")
    if not os.access(launcher, os.X_OK):
        sys.exit(f"lockstep: no launcher at {launcher}: this lockstep_torch was not installed by pip; "
                 "use the lockstep command of the build (build/tools/lockstep)")
    absent = missing()
    if absent:
        sys.exit(f"lockstep: this machine lacks {', '.join(absent)}, which the launcher loads: "
                 f"{install_hint(absent) or 'install the packages that hold them'}")
    os.execv(launcher, [launcher] + sys.argv[1:])
