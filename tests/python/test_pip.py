#!/usr/bin/python3
"""`pip install` of this checkout (pyproject.toml: scikit-build-core driving the project's CMake)
into a new venv, then the installed package used as a Python user uses it, with nothing of the
build tree on the path:

- torchrun runs an unmodified FSDP2 script (fsdp2_train.py) on "lockstep": the name is registered
  by the "torch.backends" entry point alone (torch >= 2.5; no .pth, no sitecustomize, no import);
  and a DDP script (ddp_train.py --no-init) that creates no process group, under torchrun with
  LOCKSTEP_TORCH_BACKEND=lockstep: the entry point creates it in each worker (and not in torchrun's
  own process, which imports torch too). Both end with the parameters of the same scripts on gloo,
  bit for bit (2 ranks: test_ddp.py and test_fsdp2.py say why exactly);
- the installed `lockstep` console script runs an unmodified Hugging Face Trainer script (it never
  creates a process group) with `--torch-backend lockstep`: the group the Trainer trained on is
  lockstep's, and every rank's unrounded loss at every step and its final parameters equal those of
  the same script left to create its own (gloo), bit for bit;
- an extension that cannot load leaves `import torch` working, and asking for "lockstep" then says
  why it is not there; a system library the wheel recorded and the machine lacks is named by the
  `lockstep` command with the `apt-get install` that brings it.

The venv sees the pinned torch (and scikit-build-core) of the venv running this test through a .pth
file, not a second 5 GB copy; pip builds offline (--no-index) and without build isolation (the build
must see that torch). The build directory is kept in the ctest build tree (pip-build/), so a second
run here recompiles nothing.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import unittest

import torch

import harness

harness.require_hugging_face()

ROOT = os.path.dirname(os.path.dirname(harness.HERE))
HF = os.path.join(harness.HERE, "hf")


def venv_python(venv):
    return os.path.join(venv, "bin", "python")


def plain_env(extra=None):
    """A worker's environment with nothing of the build tree: no PYTHONPATH, no launcher's variables."""
    env = harness.base_env(extra)
    env.pop("PYTHONPATH", None)
    for name in ("LOCKSTEP_TORCH_BACKEND", "TORCH_DEVICE_BACKEND_AUTOLOAD"):
        if name not in (extra or {}):
            env.pop(name, None)
    return env


def make_venv(where):
    """A new venv whose site-packages also reads the running venv's, through a .pth file."""
    subprocess.run([sys.executable, "-m", "venv", where], check=True, timeout=120)
    site = subprocess.run([venv_python(where), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "pinned-torch.pth"), "w", encoding="utf-8") as pth:
        pth.write(sysconfig.get_paths()["purelib"] + "\n")
    return site


class PipInstall(harness.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.holder = tempfile.TemporaryDirectory(prefix="pip_venv_")
        cls.venv = os.path.join(cls.holder.name, "venv")
        cls.site = make_venv(cls.venv)
        build_dir = os.path.join(harness.build_dir(), "pip-build")
        pip = [venv_python(cls.venv), "-m", "pip", "install", "--no-build-isolation", "--no-index", "--no-deps",
               f"--config-settings=build-dir={build_dir}", ROOT]
        started = time.monotonic()
        done = subprocess.run(pip, capture_output=True, text=True, timeout=1500, env=plain_env())
        if done.returncode != 0:
            raise RuntimeError(f"pip install failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}")
        print(f"pip install took {time.monotonic() - started:.0f} s", flush=True)
        cls.tokenizer = os.path.join(cls.holder.name, "tokenizer")
        made = subprocess.run([venv_python(cls.venv), os.path.join(HF, "fortune_data.py"), cls.tokenizer],
                              capture_output=True, text=True, timeout=300, env=plain_env())
        if made.returncode != 0:
            raise RuntimeError(f"training the tokenizer failed:\n{made.stderr}")

    @classmethod
    def tearDownClass(cls):
        cls.holder.cleanup()

    def python(self, code, env_extra=None):
        return subprocess.run([venv_python(self.venv), "-c", code], capture_output=True, text=True, timeout=120,
                              env=plain_env(env_extra), cwd=self.holder.name)

    def test_installs_the_package_and_the_launcher_without_a_pth_file(self):
        installed = os.listdir(self.site)
        self.assertIn("lockstep_torch", installed)
        self.assertFalse([f for f in installed if f.startswith("lockstep") and f.endswith(".pth")],
                         f"torch >= 2.5 needs no .pth file: {installed}")
        done = subprocess.run([os.path.join(self.venv, "bin", "lockstep"), "run", "--help"], capture_output=True,
                              text=True, timeout=60, env=plain_env())
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("--torch-backend", done.stdout)

    def torchrun(self, script, backend, output, flags=(), env_extra=None):
        cmd = [venv_python(self.venv), "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(harness.free_port()), os.path.join(harness.HERE, script), backend, output,
               *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=plain_env(env_extra),
                              cwd=self.holder.name)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def assert_same_state(self, ours, theirs, what):
        self.assertEqual(ours.keys(), theirs.keys())
        for name in ours:
            self.assertTrue(torch.equal(ours[name], theirs[name]), f"{what}: {name} differs from gloo's")

    def test_torchrun_workers_get_the_group_a_variable_asks_for(self):
        runs = {}
        for backend in ("lockstep", "gloo"):
            out = self.tmpdir(prefix=f"pip_ddp_{backend}_")
            if backend == "lockstep":  # the script creates no group (it checks the one it finds)
                self.torchrun("ddp_train.py", backend, out, ["--no-init"], {"LOCKSTEP_TORCH_BACKEND": "lockstep"})
            else:
                self.torchrun("ddp_train.py", backend, out)
            runs[backend] = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
        for r in range(2):
            self.assert_same_state(runs["lockstep"][r]["state"], runs["gloo"][r]["state"], f"DDP, rank {r}")
        self.assertLess(sum(runs["lockstep"][0]["losses"][-5:]), sum(runs["lockstep"][0]["losses"][:5]))

    def test_torchrun_runs_an_unmodified_fsdp2_script_on_lockstep_as_on_gloo(self):
        runs = {}
        for backend in ("lockstep", "gloo"):
            out = os.path.join(self.tmpdir(prefix=f"pip_fsdp2_{backend}_"), "rank0.pt")
            self.torchrun("fsdp2_train.py", backend, out)
            runs[backend] = torch.load(out)
        self.assertEqual(runs["lockstep"]["backend"], "lockstep")
        self.assert_same_state(runs["lockstep"]["state"], runs["gloo"]["state"], "FSDP2")

    def trainer_run(self, name, launcher_flags):
        out = self.tmpdir(prefix=f"pip_trainer_{name}_")
        cmd = [os.path.join(self.venv, "bin", "lockstep"), "run", "--timeout", "585", "--nproc-per-node", "2",
               *launcher_flags, venv_python(self.venv), os.path.join(HF, "trainer_train.py"), name, out,
               "--tokenizer", self.tokenizer, "--steps", "20", "--no-init"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=plain_env(), cwd=out)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        records = [json.loads(line.split("] ", 1)[-1]) for line in done.stdout.splitlines() if '"losses"' in line]
        self.assertEqual(len(records), 1, done.stdout)
        return records[0], [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]

    def test_an_unmodified_trainer_script_runs_on_lockstep_through_the_launcher(self):
        (ours, our_ranks) = self.trainer_run("lockstep", ["--torch-backend", "lockstep"])
        (theirs, their_ranks) = self.trainer_run("gloo", [])
        self.assertEqual(ours["group"], "lockstep")  # the group the launcher asked for, not Hugging Face's
        self.assertEqual(theirs["group"], "gloo")
        for r in range(2):
            self.assertEqual(our_ranks[r]["losses"], their_ranks[r]["losses"], f"rank {r}'s unrounded losses")
            for i, (a, b) in enumerate(zip(our_ranks[r]["parameters"], their_ranks[r]["parameters"])):
                self.assertTrue(torch.equal(a, b), f"rank {r}, parameter {i} differs from gloo's")

    def test_an_extension_that_cannot_load_leaves_torch_working(self):
        extension = glob.glob(os.path.join(self.site, "lockstep_torch", "_C*.so"))
        self.assertEqual(len(extension), 1, extension)
        hidden = extension[0] + ".hidden"
        shutil.move(extension[0], hidden)
        try:
            done = self.python("import torch, torch.distributed as dist\n"
                               "try:\n"
                               "    dist.init_process_group('lockstep', store=dist.HashStore(), rank=0, world_size=1)\n"
                               "except RuntimeError as error:\n"
                               "    print('refused:', error)\n")
        finally:
            shutil.move(hidden, extension[0])
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("refused: lockstep: the lockstep_torch extension failed to load", done.stdout)

    def test_a_missing_system_library_is_named_with_its_package(self):
        listing = os.path.join(self.site, "lockstep_torch", "runtime-libraries.txt")
        with open(listing, encoding="utf-8") as f:
            recorded = f.read()
        self.assertIn("libgloo.so.0 libgloo0", recorded)  # what the launcher and the extension load
        try:
            with open(listing, "a", encoding="utf-8") as f:
                f.write("libnot-on-this-machine.so.9 libnot-on-this-machine9\n")
            done = subprocess.run([os.path.join(self.venv, "bin", "lockstep"), "run", "--help"], capture_output=True,
                                  text=True, timeout=60, env=plain_env())
        finally:
            with open(listing, "w", encoding="utf-8") as f:
                f.write(recorded)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("lacks libnot-on-this-machine.so.9", done.stderr)
        self.assertIn("apt-get install libnot-on-this-machine9", done.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
