#!/usr/bin/python3
"""Conformance: every collective, dtype and reduce operator of the lockstep backend against gloo
and the exact answer (conformance_worker.py), world sizes 1 to 4, real processes started with
torchrun's environment. On lockstep's shm backend (what "auto" picks on one machine) at every
size, and on lockstep's gloo backend (LOCKSTEP_BACKEND=gloo) at 2 and 3 ranks."""
import os
import sys
import unittest

import harness

WORKER = os.path.join(harness.HERE, "conformance_worker.py")


class Conformance(harness.TestCase):
    def check(self, world, backend):
        ranks = harness.run_ranks(world, [harness.PYTHON, WORKER], self.tmpdir(), timeout=900,
                                  env_extra={"LOCKSTEP_BACKEND": backend})
        for r in ranks:
            records = r.records()
            self.assertEqual(r.returncode, 0, f"rank {r.rank} failed:\n{harness.describe(ranks)}")
            self.assertEqual(len(records), 1, harness.describe(ranks))
            summary = records[0]
            self.assertEqual(summary["failure_count"], 0, summary["failures"])
            self.assertEqual(summary["comm_backend"], "shm" if backend == "auto" else backend)
            self.assertGreater(summary["checks"], 1000)
            self.assertGreater(summary["gloo_checks"], 100)
            print(f"world {world} {backend}: rank {r.rank}: {summary['checks']} checks, "
                  f"{summary['gloo_checks']} against gloo", flush=True)

    def test_shm_world_1(self):
        self.check(1, "auto")

    def test_shm_world_2(self):
        self.check(2, "auto")

    def test_shm_world_3(self):
        self.check(3, "auto")

    def test_shm_world_4(self):
        self.check(4, "auto")

    def test_gloo_world_2(self):
        self.check(2, "gloo")

    def test_gloo_world_3(self):
        self.check(3, "gloo")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[1:], verbosity=2)
