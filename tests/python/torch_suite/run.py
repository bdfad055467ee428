#!/usr/bin/env python3
"""PyTorch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py,
shipped in the torch wheel) on the lockstep backend and on gloo, side by side.

The suite is what PyTorch runs for its own backends (test/distributed/test_distributed_spawn.py
in PyTorch's tree): every test spawns WORLD_SIZE processes that init_process_group(BACKEND) through
a file:// store and check a collective, DDP, a subgroup, ... Many tests ask for a backend by
name (`BACKEND == "gloo"`, `@require_backend_is_available({"gloo", "nccl"})`) and skip on any
other; the table shows those as skipped, not as passed.

    run.py [--world N] [--backends gloo,lockstep] [-k PATTERN] [--timeout S] [--start fork|spawn] [--out FILE]

"lockstep-as-gloo" runs the suite with BACKEND=gloo on lockstep groups (the creator torch calls for
"gloo" replaced by lockstep's, suite_child.py): the gloo-only tests then test lockstep too. It is
compared with gloo like "lockstep" is.

The ranks are forked from the runner by default, as PyTorch's former test_distributed_fork.py did;
--start spawn is the upstream runner's way (each rank of each test imports torch anew: about 10 s
a test on 2 cores, against a quarter of a second forked). The tests are the same either way.

Each backend runs in a process of its own (suite_child.py: the suite reads BACKEND at import).
The result: a markdown table of outcomes per backend, the tests that pass on gloo but not on
lockstep (with the reason: EXPLAINED below, or the error; the run exits 1 when one is not
explained), and those that pass on lockstep only. Needs the build tree's python/ on PYTHONPATH (or
lockstep_torch installed) for the lockstep side, and the suite's own imports (expecttest).
RESULTS.md beside this file is a run's report.
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

# Tests that pass on gloo and not on lockstep for a reason that is not a fault of lockstep's: the
# run still lists them, and exits 1 only for a test not here. (Under the name "lockstep" most
# gloo-only tests skip by name; they run, and pass, as "lockstep-as-gloo".) Each explanation holds
# only while the test ends as it says: its outcome, and a reason (the test's error or skip message)
# that contains the text given; a test failing for another reason is a regression.
PROFILER_NAME = "String comparison failed: 'lockstep:"  # its send's or its recv's, whichever rank reports
EXPLAINED = {
    "lockstep": {
        "test_ddp_logging_data_cpu": ("error", "'custom' != 'lockstep'",
                                      "DDP's logger names every third-party backend 'custom' (torch's "
                                      "ProcessGroup::getBackendName for BackendType::CUSTOM)"),
        "test_barrier_timeout_full_group": ("skipped", "Only gloo backend supports timeouts",
                                            "skips by backend name; as lockstep-as-gloo it asserts gloo's wording"),
        "test_sparse_all_reduce_sum": ("skipped", "Only Gloo backend supports sparse all reduce",
                                       "skips by backend name; sparse tensors are not supported"),
    },
    "lockstep-as-gloo": {
        "test_ddp_logging_data_cpu": ("error", "'custom' != 'gloo'",
                                      "as above: a third-party backend is 'custom' to DDP's logger"),
        "test_barrier_timeout_full_group": ("error", "barrier #0 timed out after",
                                            "asserts gloo's wording (' Timed out ', ' timeout '); lockstep's "
                                            "barrier raises 'barrier #0 timed out after 1 s on rank 0 waiting "
                                            "for rank(s) 1, ...'"),
        "test_isend_autograd_profiler": ("error", PROFILER_NAME,
                                         "compares the profiler event's name with 'gloo:recv'; lockstep's "
                                         "is 'lockstep:recv'"),
        "test_isend_torch_profiler": ("error", PROFILER_NAME, "as above ('gloo:recv')"),
        "test_send_recv_with_tag_autograd_profiler": ("error", PROFILER_NAME,
                                                      "as above ('gloo:send')"),
        "test_send_recv_with_tag_torch_profiler": ("error", PROFILER_NAME, "as above ('gloo:send')"),
        "test_sparse_all_reduce_sum": ("error", "the lockstep backend moves dense tensors",
                                       "sparse tensors are not supported (docs/python.md): lockstep raises "
                                       "naming the problem and .to_dense()"),
    },
}


def explanations(results, candidate, worse):
    """{test: why} for the tests in `worse` that end on `candidate` as EXPLAINED says they do; a
    test whose outcome or reason differs from its explanation's is left out (unexplained)."""
    explained = {}
    for test, (outcome, reason, why) in EXPLAINED.get(candidate, {}).items():
        got = results[candidate].get(test, {})
        if test in worse and got.get("outcome") == outcome and reason in got.get("reason", ""):
            explained[test] = why
    if candidate == "lockstep" and "lockstep-as-gloo" in results:
        as_gloo = results["lockstep-as-gloo"]
        explained.update({t: "skips by backend name; passes as lockstep-as-gloo" for t in worse
                          if results[candidate].get(t, {}).get("outcome") == "skipped"
                          and as_gloo.get(t, {}).get("outcome") == "passed"})
    return explained


HERE = os.path.dirname(os.path.abspath(__file__))


def tmp_for(tmp, backend):
    path = os.path.join(tmp, f"{backend}.tmp")
    os.makedirs(path, exist_ok=True)
    return path


def table(results, torch_version, world, seconds, start):
    backends = list(results)
    counts = {b: collections.Counter(r["outcome"] for r in results[b].values()) for b in backends}
    lines = [f"torch {torch_version}, WORLD_SIZE={world}, ranks by {start}, {len(results[backends[0]])} tests; "
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
    ap.add_argument("--backends", default="gloo,lockstep,lockstep-as-gloo")
    ap.add_argument("-k", action="append", default=[], help="run only tests whose name contains this")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a test may take (PyTorch's default: 300)")
    ap.add_argument("--start", choices=("fork", "spawn"), default="fork", help="how a test starts its ranks")
    ap.add_argument("--out", help="also write the report (markdown) here")
    args = ap.parse_args()
    import torch
    backends = args.backends.split(",")
    results, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as tmp:
        for backend in backends:
            json_path = os.path.join(tmp, f"{backend}.json")
            cmd = [sys.executable, os.path.join(HERE, "suite_child.py"), json_path] + args.k
            env = dict(os.environ, BACKEND=backend.split("-as-")[-1], SUITE_AS=backend.split("-as-")[0],
                       WORLD_SIZE=str(args.world), TEMP_DIR=tmp_for(tmp, backend),
                       SUITE_START=args.start, DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout), OMP_NUM_THREADS="1",
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
    lines = table(results, torch.__version__, args.world, seconds, args.start)
    regressions = []
    for candidate in [b for b in backends if b.startswith("lockstep") and "gloo" in results]:
        worse, gains = differences(results, "gloo", candidate)
        explained = explanations(results, candidate, worse)
        unexplained = [t for t in worse if t not in explained]
        regressions += unexplained
        lines += ["", f"Pass on gloo, not on {candidate}: {len(worse)}, of which {len(unexplained)} unexplained", ""]
        lines += [f"- `{t}`: {results[candidate].get(t, {}).get('outcome', 'not run')}: "
                  f"{explained.get(t) or 'UNEXPLAINED: ' + results[candidate].get(t, {}).get('reason', '')}"
                  for t in worse]
        lines += ["", f"Pass on {candidate}, not on gloo: {len(gains)}", ""]
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
