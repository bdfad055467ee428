"""One backend's run of PyTorch's distributed suite, for run.py (which sets BACKEND, WORLD_SIZE,
TEMP_DIR, SUITE_START): the upstream runner's test class, and a result that keeps each test's outcome.

    suite_child.py JSON_OUT [PATTERN ...]
"""
import json
import os
import sys
import unittest

import torch

from torch.testing._internal.distributed import distributed_test
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend


class Recorder(unittest.TextTestResult):
    """A TextTestResult that also keeps each test's outcome and the first line of its reason."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}

    @staticmethod
    def _name(test):
        return test.id().rsplit(".", 1)[-1]

    def _note(self, test, outcome, detail=""):
        """The reason: the last line naming an error (the ranks' tracebacks end in PyTorch's advice
        on reproducing), or the last line."""
        lines = [line.strip() for line in str(detail).splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "exit code" in line]
        reason = (errors or lines or [""])[-1]
        self.outcomes[self._name(test)] = {"outcome": outcome, "reason": reason[:200]}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._note(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._note(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._note(test, "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._note(test, "passed")


def lockstep_under_the_name_gloo():
    """Makes BACKEND=gloo create lockstep groups: the suite then runs its gloo-only tests (most of
    them: they check `BACKEND == "gloo"`) against lockstep, which answers as "gloo" to every test
    that asks (a test of gloo's own messages, options or profiler names fails for that reason)."""
    import torch.distributed as dist
    from lockstep_torch import _backend
    dist.Backend._ensure_backend_registered("gloo")  # torch registers its own backends on first use
    plugin = dist.Backend._plugins["GLOO"]
    dist.Backend._plugins["GLOO"] = type(plugin)(_backend._create_process_group, True)
    # Of type CUSTOM, as every third-party backend: torch's C++ (DDP's logger) casts a GLOO-typed
    # backend to ProcessGroupGloo without checking.
    dist.Backend.backend_type_map["gloo"] = dist.ProcessGroup.BackendType.CUSTOM
    # The profiler shows lockstep's collectives as lockstep:all_reduce, ... where the suite looks
    # for gloo:all_reduce: it looks for lockstep's (and checks them as it would gloo's).
    look_up = distributed_test.get_profiling_event
    distributed_test.get_profiling_event = lambda name, *a, **k: look_up(name.replace("gloo:", "lockstep:", 1), *a, **k)


if os.environ.get("SUITE_AS") == "lockstep":
    lockstep_under_the_name_gloo()


# At module level: the spawned ranks unpickle the test case by importing this file.
class TestDistBackendWithRanks(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if os.environ.get("SUITE_START") == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()


def run(json_path, pattern):
    loader = unittest.TestLoader()
    if pattern:
        loader.testNamePatterns = [f"*{p}*" for p in pattern]
    suite = loader.loadTestsFromTestCase(TestDistBackendWithRanks)
    runner = unittest.TextTestRunner(resultclass=Recorder, verbosity=2, stream=sys.stderr)
    result = runner.run(suite)
    with open(json_path, "w") as f:
        json.dump(result.outcomes, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
