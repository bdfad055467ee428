#!/usr/bin/python3
"""Hugging Face on the lockstep backend (torch 2.x with transformers, tokenizers and accelerate):
a transformers.Trainer fine-tune and an Accelerate loop of a small BERT classifier on real text
(hf/fortune_data.py), each under `lockstep run` on 2 workers and the Trainer on 4 as well, on
"lockstep" and on "gloo" (Accelerate's 4-worker run left out for CI's time: its 4 ranks reduce as
the Trainer's do). Hugging Face takes no backend name of its own choosing on CPU, so the scripts
create the process group first and Hugging Face uses it (hf/trainer_train.py says why).

What must hold: the loss falls, and the losses equal gloo's: bit for bit on 2 workers (DDP
averages sums of two floats, which are the same in any order). On 4 workers lockstep's
shared-memory reduction and gloo's ring add the four gradients in different orders, so a gradient
may differ by an ulp: the first ten losses differ by rounding only (within 1e-4 relative; measured
9e-8), and from then on training amplifies the difference the way any reordering of a sum would
(measured in three runs of each: single steps apart by 0.06% to 30% while the model learns its
task, the mean of the last 10 losses by 3e-5 to 1.3%), so the end is compared as the mean of the
last 10 losses, within 10%. The seconds per step of each are printed, not asserted.

The Trainer run is compared more closely than its log shows: every rank's own loss at every step,
unrounded (the log rounds to 4 digits and averages the ranks), and every rank's parameters at the
end, which DDP keeps bitwise equal across ranks on either backend; on 2 workers both equal gloo's
bit for bit. On 4 workers the parameters are not compared with gloo's: the reordered sums grow into
differences as large as the losses' above, so no tolerance tighter than "it trained" would hold
(the largest difference is printed).

That training happened is checked as the mean of the last 10 losses below 0.95x the mean of the
first 10: a model that does not learn stays at chance (at lr 0 the ratio was 1.001),
while one that learns ends, over three tokenizers here, at 0.55-0.62 (Trainer, 2 workers),
0.33-0.38 (4), 0.66-0.71 (Accelerate, 2) and 0.30-0.34 (4). How far it falls depends on the
host's kernels and the tokenizer's tie-breaks: one CI host ended a 2-worker Trainer run at lr 2e-3
(since lowered to 1e-3, whose curves spike less) at 0.88.
"""
import json
import os
import subprocess
import tempfile
import unittest

import torch

import harness

harness.require_hugging_face()

HF = os.path.join(harness.HERE, "hf")
SCRIPTS = {"trainer": os.path.join(HF, "trainer_train.py"), "accelerate": os.path.join(HF, "accelerate_train.py")}


class HuggingFace(harness.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.holder = tempfile.TemporaryDirectory(prefix="hf_tokenizer_")
        cls.tokenizer = cls.holder.name
        done = subprocess.run([harness.PYTHON, os.path.join(HF, "fortune_data.py"), cls.tokenizer],
                              capture_output=True, text=True, timeout=300, env=harness.base_env())
        if done.returncode != 0:
            raise RuntimeError(f"training the tokenizer failed:\n{done.stderr}")

    @classmethod
    def tearDownClass(cls):
        cls.holder.cleanup()

    def run_script(self, name, backend, world):
        out = self.tmpdir(prefix=f"hf_{name}_")
        argv = [harness.PYTHON, SCRIPTS[name], backend] + ([out] if name == "trainer" else [])
        env = {"PYTHONPATH": os.path.join(harness.build_dir(), "python") + os.pathsep + HF}
        code, output = harness.run_launcher_for(backend, world, argv + ["--tokenizer", self.tokenizer], out,
                                                timeout=600, env_extra=env)
        self.assertEqual(code, 0, output)
        records = [json.loads(line.split("] ", 1)[-1]) for line in output.splitlines() if '"losses"' in line]
        self.assertEqual(len(records), 1, output)
        record = records[0]
        self.assertEqual(record["group"], backend)  # Hugging Face ran on the group the script made
        losses = record["losses"]
        self.assertLess(sum(losses[-10:]) / 10, 0.95 * sum(losses[:10]) / 10, f"the loss did not fall: {losses}")
        print(f"{name} on {backend}, {world} workers: {record['seconds_per_step'] * 1000:.1f} ms a step, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        if name == "trainer":
            return losses, [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
        return losses, None

    def assert_replicas_equal(self, ranks, backend):
        """DDP's promise: every rank applies the same averaged gradient, so the ranks' parameters
        stay bitwise equal, whatever the order the backend summed in."""
        for r, other in enumerate(ranks[1:], start=1):
            for i, (a, b) in enumerate(zip(ranks[0]["parameters"], other["parameters"])):
                self.assertTrue(torch.equal(a, b), f"{backend}: parameter {i} of rank {r} differs from rank 0's "
                                                   f"by up to {(a - b).abs().max().item():.3g}")

    def compare_trainer_ranks(self, lockstep, gloo, world):
        """The Trainer's unrounded per-rank losses and final parameters against gloo's."""
        self.assert_replicas_equal(lockstep, "lockstep")
        self.assert_replicas_equal(gloo, "gloo")
        largest = max((a - b).abs().max().item() for a, b in zip(lockstep[0]["parameters"], gloo[0]["parameters"]))
        print(f"trainer, {world} workers: final parameters up to {largest:.3g} from gloo's", flush=True)
        for r in range(world):
            ours, theirs = lockstep[r]["losses"], gloo[r]["losses"]
            self.assertEqual(len(ours), len(theirs))
            if world == 2:  # two floats sum alike in either order: every bit the same
                self.assertEqual(ours, theirs, f"rank {r}'s unrounded losses")
            else:  # rounding only over the first ten steps, as the module's docstring measures
                for step, (a, b) in enumerate(zip(ours[:10], theirs[:10])):
                    self.assertLess(abs(a - b) / abs(b), 1e-4, f"rank {r}, step {step + 1}: {a!r} against {b!r}")
        if world == 2:
            for i, (a, b) in enumerate(zip(lockstep[0]["parameters"], gloo[0]["parameters"])):
                self.assertTrue(torch.equal(a, b), f"parameter {i}: up to {(a - b).abs().max().item():.3g} from gloo's")

    def compare(self, name, world):
        (lockstep, our_ranks), (gloo, their_ranks) = self.run_script(name, "lockstep", world), self.run_script(name, "gloo", world)
        if our_ranks:
            self.compare_trainer_ranks(our_ranks, their_ranks, world)
        self.assertEqual(len(lockstep), len(gloo))
        relative = [abs(a - b) / abs(b) for a, b in zip(lockstep, gloo)]
        end = abs(sum(lockstep[-10:]) - sum(gloo[-10:])) / sum(gloo[-10:])
        print(f"{name}, {world} workers: relative loss difference: steps 1-10 up to {max(relative[:10]):.3g}, "
              f"any step up to {max(relative):.3g}, mean of the last 10: {end:.3g}", flush=True)
        if world == 2:
            self.assertEqual(lockstep, gloo)
            return
        self.assertLess(max(relative[:10]), 1e-4)
        self.assertLess(end, 0.10)

    def test_trainer_2_workers(self):
        self.compare("trainer", 2)

    def test_trainer_4_workers(self):
        self.compare("trainer", 4)

    def test_accelerate_2_workers(self):
        self.compare("accelerate", 2)


if __name__ == "__main__":
    unittest.main(verbosity=2)
