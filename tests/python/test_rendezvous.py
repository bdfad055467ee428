#!/usr/bin/python3
"""Every way init_process_group meets its peers works with "lockstep": env:// (the other tests),
file://, tcp:// and an explicit store, with none of torchrun's variables set. And the backend is
registered by the .pth file an install puts in dist-packages, or by `lockstep run` (which puts its
build tree's python/ on the workers' path), and by nothing else: importing
lockstep_torch on top of it is harmless, and programs that never import torch do not pay for it."""
import json
import os
import subprocess
import time
import unittest

import harness

WORKER = os.path.join(harness.HERE, "rendezvous_worker.py")


class Rendezvous(harness.TestCase):
    def run_world(self, mode, address, world=2):
        env = harness.base_env()
        procs = [subprocess.Popen([harness.PYTHON, WORKER, mode, str(r), str(world), address], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        deadline = time.monotonic() + 120
        outputs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            outputs.append((p.returncode, out))
        for code, out in outputs:
            self.assertEqual(code, 0, out)
            record = json.loads([line for line in out.splitlines() if line.startswith("{")][0])
            self.assertEqual(record["sum"], world * (world + 1) / 2)
            self.assertEqual(record["comm_backend"], "shm")

    def test_file_init_method(self):
        self.run_world("file", os.path.join(self.tmpdir(), "rendezvous"))

    def test_tcp_init_method(self):
        self.run_world("tcp", f"127.0.0.1:{harness.free_port()}")

    def test_explicit_store(self):
        self.run_world("store", f"127.0.0.1:{harness.free_port()}", world=3)


class Registration(harness.TestCase):
    def python(self, code, pythonpath=True):
        env = harness.base_env()
        if not pythonpath:
            env.pop("PYTHONPATH")
        return subprocess.run([harness.PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    def test_pth_file_registers_the_backend(self):
        site = os.path.join(harness.build_dir(), "python")
        done = self.python(f"import site; site.addsitedir({site!r}); import torch.distributed as d; "
                           "print(hasattr(d.Backend, 'LOCKSTEP'))", pythonpath=False)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.strip(), "True")

    def test_import_after_autoload_is_harmless(self):
        done = self.python("import torch.distributed as d, lockstep_torch; lockstep_torch.register(); "
                           "print(d.Backend('lockstep'), lockstep_torch.available_backends())")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("lockstep ['shm'", done.stdout)

    def test_lockstep_run_needs_no_pythonpath(self):
        """The launcher puts its build tree's python/ on a worker's path: an unmodified script
        that only says init_process_group("lockstep") runs with no PYTHONPATH set."""
        script = os.path.join(self.tmpdir(), "train.py")
        with open(script, "w") as f:
            f.write("import json, torch, torch.distributed as dist\n"
                    "dist.init_process_group('lockstep')\n"
                    "t = torch.full((8,), float(dist.get_rank() + 1)); dist.all_reduce(t)\n"
                    "print(json.dumps({'sum': t[0].item()}))\n")
        env = harness.base_env()
        env.pop("PYTHONPATH")
        done = subprocess.run([harness.lockstep_binary(), "run", "--timeout", "100", "--nproc-per-node", "2",
                               harness.PYTHON, script], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertEqual(done.stdout.count('{"sum": 3.0}'), 2, done.stdout)

    def test_another_torch_gets_an_error_naming_the_python_to_use(self):
        """The extension loaded into a torch other than the one it links would crash the process:
        Debian's python3 with the build for the venv's torch 2.x (or the other way round) gets an
        error from init_process_group naming both torches and the python to use."""
        other = "/usr/bin/python3"
        if os.path.realpath(other) == os.path.realpath(harness.PYTHON):
            self.skipTest(f"no second python with another torch here (the build's python is {other})")
        env = harness.base_env()
        store = os.path.join(self.tmpdir(), "store")
        program = ("import torch.distributed as d; "
                   f"d.init_process_group('lockstep', init_method='file://{store}', rank=0, world_size=1)")
        done = subprocess.run([other, "-c", program], env=env, capture_output=True, text=True, timeout=120)
        if "No module named 'torch'" in done.stderr:
            self.skipTest(f"{other} has no torch")
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("lockstep_torch was built for torch", done.stderr)
        self.assertIn(harness.PYTHON, done.stderr)

    def test_an_extension_that_fails_to_load_leaves_torch_working(self):
        """The autoload runs while `import torch` itself imports torch.distributed: an extension that
        cannot load (here one that raises on import) must leave torch importable, and only asking for
        "lockstep" is an error, naming why. (On torch 2.x, registering the explanation without its
        devices consulted torch.accelerator before torch had it, and `import torch` died.)"""
        fake = os.path.join(self.tmpdir(), "fake")
        os.makedirs(os.path.join(fake, "lockstep_torch"))
        with open(os.path.join(fake, "lockstep_torch", "__init__.py"), "w") as f:
            f.write("raise ImportError('simulated: built for another torch')\n")
        env = harness.base_env()
        env["PYTHONPATH"] = fake + os.pathsep + env["PYTHONPATH"]
        store = os.path.join(self.tmpdir(), "store")
        program = ("import torch, torch.distributed as d; print('imported', flush=True); "
                   f"d.init_process_group('lockstep', init_method='file://{store}', rank=0, world_size=1)")
        done = subprocess.run([harness.PYTHON, "-c", program], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(done.stdout.strip(), "imported", done.stderr)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("lockstep_torch extension failed to load: ImportError: simulated", done.stderr)

    def test_programs_without_torch_do_not_load_it(self):
        done = self.python("import sys, json; print('torch' in sys.modules, 'lockstep_torch' in sys.modules)")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.strip(), "False False")


if __name__ == "__main__":
    unittest.main(verbosity=2)
