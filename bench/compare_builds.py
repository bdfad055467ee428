#!/usr/bin/python3
"""Two builds of lockstep side by side, in one run on this machine: did a change cost speed?

For a change that must keep lockstep's speed (a refactor), it times lockstep's own sides of
compare_allreduce.py, compare_ddp.py and compare_zero.py on a build from before the change
(--old) and one from after it (--new), interleaved --repeat times so that the machine's load
falls on both alike:
  all-reduce, shm and gloo, 2 ranks   lockstep bench allreduce (busbw at 64 KiB, 1 MiB, 16 MiB)
  DDP, 2 workers                      bench/ddp_bench under lockstep run (the MLP, samples/s)
  ZeRO-2, 2 workers                   examples/gpt --zero-stage 2 under lockstep run (samples/s)
and prints the median of each side on each build and new/old. One intra-op and one BLAS thread
per worker, the same OPENBLAS_CORETYPE on both builds (the CPU's best when OpenBLAS picks slower
kernels by itself), as compare_ddp.py does.

    /usr/bin/python3 bench/compare_builds.py --old /tmp/old/build --new build [--repeat 3]
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_allreduce  # noqa: E402
import compare_ddp  # noqa: E402
import compare_zero  # noqa: E402

SIZES = {"64 KiB": 64 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20}


def allreduce_busbw(build, backend):
    rows = compare_allreduce.run_lockstep(build, backend, 2, min(SIZES.values()), max(SIZES.values()), False)
    # 2 ranks: the bus factor 2(n-1)/n is 1, so busbw is bytes over time.
    return {name: size / (rows[size]["time_us"] * 1e-6) / 1e9 for name, size in SIZES.items()}


def ddp_samples(build, env):
    bench = os.path.join(build, "bench", "ddp_bench")
    cmd = [os.path.join(build, "tools", "lockstep"), "run", "--nproc-per-node", "2", bench, "--model", "mlp",
           "--steps", str(compare_ddp.STEPS["mlp"])]
    return compare_ddp.run(cmd, env)["samples_per_s"]


def zero2_samples(build, env):
    return compare_zero.lockstep_run(build, "gpt", ["--zero-stage", "2"], 40, env)["samples_per_s"]


def measure_once(build, env):
    got = {}
    for backend in ("shm", "gloo"):
        for size, busbw in allreduce_busbw(build, backend).items():
            got[f"all-reduce {backend} {size}, busbw GB/s"] = busbw
    got["DDP MLP 2 workers, samples/s"] = ddp_samples(build, env)
    got["ZeRO-2 GPT 2 workers, samples/s"] = zero2_samples(build, env)
    return got


def kernels_env(build):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824")
    bench = os.path.join(build, "bench", "ddp_bench")
    detected, best = compare_ddp.openblas_core(bench, env), compare_ddp.best_openblas_core()
    if "OPENBLAS_CORETYPE" not in env and detected and \
            compare_ddp.LEVEL.get(detected.lower(), 9) < compare_ddp.LEVEL.get(best.lower(), -1):
        env["OPENBLAS_CORETYPE"] = best
    return env, env.get("OPENBLAS_CORETYPE", detected or "not OpenBLAS")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the build from before the change")
    ap.add_argument("--new", default=os.path.join(HERE, "..", "build"), help="the build from after it")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    env, kernels = kernels_env(args.new)
    runs = {"old": [], "new": []}
    for _ in range(args.repeat):
        for side, build in (("old", args.old), ("new", args.new)):
            runs[side].append(measure_once(build, env))
    print(f"CPU: {compare_ddp.cpu_name()}; "
          f"BLAS {compare_ddp.blas()}, kernels {kernels}, 1 thread per worker; median of {args.repeat}, "
          f"old and new interleaved\n")
    print("| side | old: median (range) | new: median (range) | new/old |\n|---|---|---|---|")
    for key in runs["old"][0]:
        cells = []
        for side in ("old", "new"):
            values = [r[key] for r in runs[side]]
            cells.append((statistics.median(values), min(values), max(values)))
        (old, *_), (new, *_) = cells
        shown = " | ".join(f"{m:.2f} ({lo:.2f}-{hi:.2f})" for m, lo, hi in cells)
        print(f"| {key} | {shown} | {new / old:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
