"""The benchmark peers' environment: the venv bench/peers/setup makes (DeepSpeed and torchft,
pinned, beside the pinned torch venv), which every bench/compare_* that runs a peer finds by itself."""
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def peers():
    """(python, errors): the peers venv's python, brought to the pins by bench/peers/setup, and
    {peer: why} for each peer that did not install (the comparisons print it in the peer's place).
    python is None when the venv itself could not be made; errors["setup"] says why."""
    done = subprocess.run([os.path.join(HERE, "peers", "setup")], capture_output=True, text=True)
    if done.returncode != 0:
        return None, {"setup": (done.stderr.strip().splitlines() or ["bench/peers/setup failed"])[-1]}
    python = done.stdout.strip().splitlines()[-1]
    errors_dir = os.path.join(os.path.dirname(os.path.dirname(python)), "lockstep-peer-errors")
    errors = {}
    for name in sorted(os.listdir(errors_dir)) if os.path.isdir(errors_dir) else []:
        if not name.endswith(".log"):
            with open(os.path.join(errors_dir, name)) as f:
                errors[name] = " ".join(f.read().split()) or "pip failed"
    return python, errors


def why_not(errors, peer):
    """The reason `peer` is missing, for a comparison's report."""
    return errors.get(peer) or errors.get("setup") or f"{peer} did not import in the peers venv"
