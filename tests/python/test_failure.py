#!/usr/bin/python3
"""Failure contract: a rank killed (SIGKILL) in the middle of an all-reduce makes every
surviving rank raise a Python RuntimeError naming it within 10 seconds, never hang: on lockstep's
shm backend (the peer's liveness lock, checked while waiting) and on its gloo backend (the peer's
socket and the store's liveness keys). Real processes with torchrun's environment; the test kills
the victim once it has printed that its all-reduce loop runs."""
import os
import select
import signal
import subprocess
import time
import unittest

import harness

WORKER = os.path.join(harness.HERE, "failure_worker.py")
VICTIM = 1
DEADLINE_S = 10


class KilledRank(harness.TestCase):
    def kill_mid_allreduce(self, world, backend):
        ranks = harness.start_ranks(world, [harness.PYTHON, WORKER], self.tmpdir(), env_extra={"LOCKSTEP_BACKEND": backend},
                                    pipe_rank=VICTIM)
        victim = ranks[VICTIM].process
        ready, _, _ = select.select([victim.stdout], [], [], 120)
        line = victim.stdout.readline() if ready else b""
        deadline = time.monotonic() + 60
        if b"looping" not in line:
            for r in ranks:
                r.process.kill()
            self.fail(f"the victim never reached its loop: {line!r}\n{harness.describe([r.finish(deadline) for r in ranks])}")
        victim.send_signal(signal.SIGKILL)
        killed_at = time.time()
        survivors = [r.finish(deadline) for r in ranks if r.rank != VICTIM]
        ranks[VICTIM].finish(deadline)
        for r in survivors:
            records = r.records()
            self.assertEqual(r.returncode, 3, f"rank {r.rank} did not raise:\n{harness.describe(survivors)}")
            self.assertEqual(len(records), 1, r.output)
            error, took = records[0]["error"], records[0]["raised_at"] - killed_at
            print(f"{backend}, {world} ranks: rank {r.rank} raised {took:.2f} s after the kill: {error}", flush=True)
            self.assertIn(f"rank {VICTIM}", error, "the error does not name the dead rank")
            self.assertLess(took, DEADLINE_S)

    def test_shm_3_ranks(self):
        self.kill_mid_allreduce(3, "shm")

    def test_shm_2_ranks(self):
        self.kill_mid_allreduce(2, "shm")

    def test_gloo_3_ranks(self):
        self.kill_mid_allreduce(3, "gloo")


if __name__ == "__main__":
    unittest.main(verbosity=2)
