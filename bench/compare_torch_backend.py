#!/usr/bin/python3
"""PyTorch on lockstep's torch.distributed backend: the same PyTorch DDP script with the backend
string "lockstep" and with "gloo", next to lockstep's own C++ DDP, and torch.distributed.all_reduce
swept over message sizes on both backends.

DDP: for each model (mlp 784-1024-1024-10, wide 784-2048x3-10, cnn: the example's CNN), per-worker
batch 64, one intra-op and one BLAS thread per worker, 2 workers under `lockstep run`, it runs
interleaved, --repeat times:
  lockstep C++ DDP               build/bench/ddp_bench (buckets in shared memory)
  PyTorch DDP, backend lockstep  bench/torch_ddp.py --backend lockstep
  PyTorch DDP, backend gloo      bench/torch_ddp.py --backend gloo
  PyTorch 2 workers, no_sync     bench/torch_ddp.py --no-sync (no communication: the ceiling)
and, with --bucket-view, both PyTorch DDP sides again with gradient_as_bucket_view=True (DDP's
option that spares copying every gradient into its bucket and back: two passes over the
gradients that no backend can avoid, and the largest part of the gap to lockstep's C++ DDP, whose
gradients live in its buckets). It prints median samples/s (and range), and the floors of issues
#17 and #57: PyTorch DDP on lockstep within 15% of lockstep's C++ DDP on every model, and at least
1.5x PyTorch DDP on gloo (the same DDP options on both) on both MLPs.
Models, steps and batch are bench/compare_ddp.py's; so are the BLAS kernel choice and the malloc
tunables every side runs with.

all_reduce: f32 sum, 2 ranks, 4 KiB to --sweep-max, each size warmed up, then timed over as many
calls as fit in ~512 MiB of traffic (5 to 2000); the time is the slower rank's mean per call.

    /usr/bin/python3 bench/compare_torch_backend.py [--build build] [--repeat 3] [--models mlp,wide,cnn]
                                                    [--bucket-view] [--sweep-max-mib 256] [--skip-ddp] [--skip-sweep]
                                                    [--json out.json] [--python /usr/bin/python3]
The build must have the extension (-DLOCKSTEP_PYTHON=ON) and the targets lockstep and ddp_bench.
--python is the python its extension was built for: /usr/bin/python3 (torch 1.13) for a Debian
build, the venv's python for a build on the wheel (`--build build-torch2 --python VENV/bin/python`).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_ddp  # noqa: E402  (the models' step counts, BLAS detection, run())

KIB = 1024


PYTHON = ["/usr/bin/python3"]  # set from --python


def environment(build):
    """Every side's environment: one thread each, the malloc tunables, the BLAS kernels, and the
    build tree's python/ on PYTHONPATH (which registers "lockstep" with torch.distributed)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824")
    env["PYTHONPATH"] = os.path.join(build, "python")
    bench = os.path.join(build, "bench", "ddp_bench")
    detected, best = compare_ddp.openblas_core(bench, env), compare_ddp.best_openblas_core()
    if "OPENBLAS_CORETYPE" in env:
        kernels = f"OpenBLAS kernels {env['OPENBLAS_CORETYPE']} (OPENBLAS_CORETYPE set by the caller)"
    elif not detected:
        kernels = "BLAS: not OpenBLAS"
    elif compare_ddp.LEVEL.get(detected.lower(), 9) < compare_ddp.LEVEL.get(best.lower(), -1):
        env["OPENBLAS_CORETYPE"] = best
        kernels = f"OpenBLAS kernels {best} on every side (OPENBLAS_CORETYPE; by itself OpenBLAS picks {detected})"
    else:
        kernels = f"OpenBLAS kernels {detected}, as OpenBLAS picked them"
    return env, kernels


LOCKSTEP, GLOO = "PyTorch DDP, backend lockstep", "PyTorch DDP, backend gloo"
VIEW = " (bucket views)"


def ddp(build, env, models, repeat, bucket_view):
    lockstep = os.path.join(build, "tools", "lockstep")
    two = [lockstep, "run", "--nproc-per-node", "2"]
    peer = [PYTHON[0], os.path.join(HERE, "torch_ddp.py")]
    results = {}
    for model in models:
        common = ["--model", model, "--steps", str(compare_ddp.STEPS[model])]
        sides = {
            "lockstep C++ DDP": two + [os.path.join(build, "bench", "ddp_bench")] + common,
            LOCKSTEP: two + peer + common + ["--backend", "lockstep"],
            GLOO: two + peer + common + ["--backend", "gloo"],
            "PyTorch 2 workers, no_sync": two + peer + common + ["--no-sync"],
        }
        if bucket_view:
            sides[LOCKSTEP + VIEW] = sides[LOCKSTEP] + ["--gradient-as-bucket-view"]
            sides[GLOO + VIEW] = sides[GLOO] + ["--gradient-as-bucket-view"]
        got = {k: [] for k in sides}
        for _ in range(repeat):
            for name, cmd in sides.items():
                got[name].append(compare_ddp.run(cmd, env))
        results[model] = got
    return results


def print_ddp(results, repeat):
    print(f"\n## PyTorch DDP, 2 workers: median of {repeat} interleaved runs, samples/s\n")
    print("| model | side | samples/s (range) | vs lockstep C++ DDP | vs PyTorch DDP on gloo | of no_sync |")
    print("|---|---|---|---|---|---|")
    floors = []
    for model, got in results.items():
        med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in got.items()}
        for name, runs in got.items():
            rates = [r["samples_per_s"] for r in runs]
            cpp = f"{med[name] / med['lockstep C++ DDP']:.2f}x"
            gloo = f"{med[name] / med[GLOO + VIEW if name.endswith(VIEW) else GLOO]:.2f}x"
            ceiling = f"{med[name] / med['PyTorch 2 workers, no_sync']:.0%}"
            print(f"| {model} | {name} | {med[name]:.0f} ({min(rates):.0f}-{max(rates):.0f}) | {cpp} | {gloo} | "
                  f"{ceiling} |")
        for options in ("", VIEW):
            if LOCKSTEP + options not in med:
                continue
            vs_cpp = med[LOCKSTEP + options] / med["lockstep C++ DDP"]
            vs_gloo = med[LOCKSTEP + options] / med[GLOO + options]
            floors.append(f"- {model}{options or ' (DDP defaults)'}: PyTorch DDP on lockstep is {vs_cpp:.2f}x "
                          f"lockstep's C++ DDP (floor 0.85x: {'met' if vs_cpp >= 0.85 else 'NOT met'}) and "
                          f"{vs_gloo:.2f}x PyTorch DDP on gloo" +
                          (f" (floor 1.5x: {'met' if vs_gloo >= 1.5 else 'NOT met'})" if model != "cnn" else
                           " (the CNN has no floor; reported)"))
    print("\nFloors (issues #17 and #57):\n" + "\n".join(floors))


def sweep(build, env, max_bytes):
    lockstep = os.path.join(build, "tools", "lockstep")
    results = {}
    for backend in ("lockstep", "gloo"):
        cmd = [lockstep, "run", "--nproc-per-node", "2", PYTHON[0],
               os.path.join(HERE, "torch_allreduce.py"), str(4 * KIB), str(max_bytes), backend]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        rows = []
        for line in out.stdout.splitlines():
            line = line.split("] ", 1)[-1] if line.startswith("[rank") else line
            if line.startswith("{"):
                rows.append(json.loads(line))
        if out.returncode != 0 or not rows:
            raise SystemExit(f"sweep on {backend} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        results[backend] = rows
    return results


def size_text(n):
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 else f"{n // KIB} KiB"


def print_sweep(results):
    print("\n## torch.distributed.all_reduce, f32 sum, 2 ranks, 1 thread each: mean time per call "
          "(the slower rank's), busbw = algbw x 2(n-1)/n\n")
    print("| size | lockstep us | lockstep busbw GB/s | gloo us | gloo busbw GB/s | lockstep / gloo speed |")
    print("|---|---|---|---|---|---|")
    gloo = {r["bytes"]: r for r in results["gloo"]}
    for r in results["lockstep"]:
        g = gloo[r["bytes"]]
        busbw = lambda row: row["bytes"] / (row["time_us"] * 1e-6) / 1e9  # 2(n-1)/n = 1 for n = 2
        print(f"| {size_text(r['bytes'])} | {r['time_us']:.1f} | {busbw(r):.2f} | {g['time_us']:.1f} | "
              f"{busbw(g):.2f} | {g['time_us'] / r['time_us']:.2f}x |")
    wrong = results["lockstep"][0]["wrong"] + results["gloo"][0]["wrong"]
    print(f"\ncorrectness check (one 256 KiB all_reduce per backend): {wrong} wrong elements")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models", default="mlp,wide,cnn")
    ap.add_argument("--sweep-max-mib", type=int, default=256)
    ap.add_argument("--bucket-view", action="store_true",
                    help="also both PyTorch DDP sides with gradient_as_bucket_view=True")
    ap.add_argument("--skip-ddp", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--python", default="/usr/bin/python3", help="the python the build's extension is for")
    args = ap.parse_args()
    PYTHON[0] = args.python
    build = os.path.abspath(args.build)
    env, kernels = environment(build)
    print(f"# PyTorch on lockstep's torch.distributed backend vs gloo\n\n"
          f"CPU: {compare_ddp.cpu_name()}, {os.cpu_count()} cores, {platform.machine()}; PyTorch sides: "
          f"{compare_ddp.torch_build(args.python)} ({args.python}); lockstep C++: "
          f"BLAS {compare_ddp.blas()}, {kernels}; threads: 1 intra-op + 1 BLAS thread per worker "
          f"(OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1, torch.set_num_threads(1)); "
          f"GLIBC_TUNABLES={env['GLIBC_TUNABLES']} on every side")
    results = {}
    if not args.skip_ddp:
        results["ddp"] = ddp(build, env, args.models.split(","), args.repeat, args.bucket_view)
        print_ddp(results["ddp"], args.repeat)
    if not args.skip_sweep:
        results["all_reduce"] = sweep(build, env, args.sweep_max_mib << 20)
        print_sweep(results["all_reduce"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
