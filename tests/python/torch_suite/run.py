#!/usr/bin/env python3
"""PyTorch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py,
shipped in the torch wheel) on the lockstep backend and on gloo, side by side.

The suite is what PyTorch runs for its own backends (test/distributed/test_distributed_spawn.py
in PyTorch's tree): every test spawns WORLD_SIZE processes that init_process_group(BACKEND) through
a file:// store and check a collective, DDP, a subgroup, ... Many tests ask for a backend by
name (`BACKEND == "gloo"`, `@require_backend_is_available({"gloo", "nccl"})`) and skip on any
other; the table shows those as skipped, not as passed.

    run.py [--world N] [--backends gloo,lockstep] [-k PATTERN] [--timeout S] [--out FILE]

Each backend runs in a process of its own (suite_child.py: the suite reads BACKEND at import). The result: a
markdown table of outcomes per backend, the tests that pass on gloo but not on lockstep (the
regressions: the run exits 1 when there is one), and those that pass on lockstep only. Needs the
build tree's python/ on PYTHONPATH (or lockstep_torch installed) for the lockstep side.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

OUTCOMES = ("passed", "failed", "error", "skipped", "expected failure")
HERE = os.path.dirname(os.path.abspath(__file__))


def tmp_for(tmp, backend):
    path = os.path.join(tmp, f"{backend}.tmp")
    os.makedirs(path, exist_ok=True)
    return path


def table(results, torch_version, world, seconds):
    backends = list(results)
    counts = {b: collections.Counter(r["outcome"] for r in results[b].values()) for b in backends}
    lines = [f"torch {torch_version}, WORLD_SIZE={world}, {len(results[backends[0]])} tests; "
             + ", ".join(f"{b} {seconds[b]:.0f} s" for b in backends), "",
             "| outcome | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for outcome in OUTCOMES:
        lines.append(f"| {outcome} | " + " | ".join(str(counts[b][outcome]) for b in backends) + " |")
    return lines


def differences(results, reference, candidate):
    """Tests that pass on `reference` but not on `candidate`, and the other way round."""
    ref, cand = results[reference], results[candidate]
    worse = sorted(t for t, r in ref.items() if r["outcome"] == "passed" and cand.get(t, {}).get("outcome") != "passed")
    better = sorted(t for t, r in cand.items() if r["outcome"] == "passed" and ref.get(t, {}).get("outcome") != "passed")
    return worse, better


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backends", default="gloo,lockstep")
    ap.add_argument("-k", action="append", default=[], help="run only tests whose name contains this")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a test may take (PyTorch's default: 300)")
    ap.add_argument("--out", help="also write the report (markdown) here")
    args = ap.parse_args()
    import torch
    backends = args.backends.split(",")
    results, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as tmp:
        for backend in backends:
            json_path = os.path.join(tmp, f"{backend}.json")
            cmd = [sys.executable, os.path.join(HERE, "suite_child.py"), json_path] + args.k
            env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(args.world), TEMP_DIR=tmp_for(tmp, backend),
                       DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout), OMP_NUM_THREADS="1",
                       PYTHONWARNINGS="ignore")
            start = time.monotonic()
            with open(os.path.join(tmp, f"{backend}.log"), "w") as log:
                subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
            seconds[backend] = time.monotonic() - start
            if not os.path.exists(json_path):
                with open(os.path.join(tmp, f"{backend}.log")) as log:
                    sys.exit(f"the suite did not run on {backend}:\n{log.read()[-3000:]}")
            with open(json_path) as f:
                results[backend] = json.load(f)
    lines = table(results, torch.__version__, args.world, seconds)
    regressions = []
    if "gloo" in results and "lockstep" in results:
        regressions, gains = differences(results, "gloo", "lockstep")
        lines += ["", f"Pass on gloo, not on lockstep ({len(regressions)}):", ""]
        lines += [f"- `{t}`: {results['lockstep'].get(t, {}).get('outcome', 'not run')}: "
                  f"{results['lockstep'].get(t, {}).get('reason', '')}" for t in regressions]
        lines += ["", f"Pass on lockstep, not on gloo ({len(gains)}):", ""]
        lines += [f"- `{t}`: gloo {results['gloo'].get(t, {}).get('outcome', 'not run')}: "
                  f"{results['gloo'].get(t, {}).get('reason', '')}" for t in gains]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
