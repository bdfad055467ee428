import sys, os, json, glob
sys.path.insert(0, "bench")
from compare_compression import run_job, hook_flags
from compare_cluster import Cluster
c = Cluster(2, "10gbit")
try:
    for hook in sys.argv[1].split(","):
        out = f"/tmp/gnout-{hook.replace(':','-')}"
        os.system(f"rm -rf {out}")
        run_job(c, "build", ["build/examples/gpt", "--max-steps", sys.argv[2], "--output-dir", out, "--disable-tqdm",
            "--save-strategy", "no", "--eval-strategy", "no", "--eval-limit", "200", "--comm-hook-start-step", "10",
            "--logging-steps", "10"] + sys.argv[3:] + hook_flags(hook))
        print(hook, open(out + "/eval_results.json").read().replace("\n", " "))
        print(os.listdir(out))
finally:
    c.close()
