#!/usr/bin/env python3
"""PyTorch's own torch.distributed tests (`DistributedTest._DistTestBase`), on CPU tensors,
against a named backend: "gradwire" (a third-party backend, registered by `import
gradwire.torch`) or "gloo" (the reference the same selection is held against).

    python3 python/tests/torch_dist_suite.py --backend gradwire --world-size 2
        [--only REGEX] [--list] [--all] [--timeout S] [--expect-fail FILE]
        [--start-method spawn|fork] [--log FILE] [--verbose]

It runs them as torch's test/distributed/test_distributed_spawn.py does: one
`TestDistBackend` + `_DistTestBase` class per backend, each test in `world_size` fresh
rank processes (spawned: each re-imports this file, so everything below that registers
the backend or adjusts torch's tables runs at import, in the runner and in every rank).
torch's test base reads BACKEND, WORLD_SIZE, TEMP_DIR and INIT_METHOD from the
environment when it is imported and decides most skips then, so the runner sets them
before importing it; the rank processes inherit them.

What is adjusted in torch's test base, for "gradwire" only (gloo runs it untouched), the
way a backend that is not built into torch has to:
1. `DistTestCases.backend_feature`: "plugin" (so `require_backend_is_available` counts it
   as available: torch's own check knows only gloo, nccl, mpi and ucc), "subgroup" and
   "ddp" (gradwire has both), and "gpu" (gradwire takes CUDA tensors too; the tests gated on
   this set that need GPUs still check the GPU count in the rank and skip; on CPU the set
   only opens the object-collective tests, which gloo runs on CPU).
2. The tests in UNLOCK below are marked skipped by torch for every backend but one named
   one ("Only gloo backend supports timeouts", "GLOO Batch Send Recv CPU",
   require_backend_is_available({"gloo"}), "Only MPI supports all_to_all", ...), although
   they are plain CPU tests of calls gradwire offers (timeouts, batch_isend_irecv,
   coalesced all-reduce, monitored_barrier, all-to-all, get_future, object scatter). For
   gradwire their skip mark is cleared, only when torch's reason is the expected one.
Nothing else in torch is changed; the test bodies are torch's.

The selection (SELECTION, regexes matched against test names) is the CPU subset for the
calls gradwire offers; tests that need GPUs, NCCL or torchvision are left out. The tests
torch skips below 8 ranks (`skip_if_small_worldsize`: the `_group_` forms) are reported as
SKIP without starting ranks.

Each test has a limit (--timeout, default 60 s): past it the ranks are killed and the test
is a TIMEOUT (counted as failed). One line per test: PASS / FAIL / TIMEOUT / SKIP (and
XFAIL / XPASS for tests listed in --expect-fail), then the summary
`torch dist suite BACKEND wsN: P passed, F failed, S skipped`. The ranks' own output (and
the full tracebacks) go to the log file (--log, default in the temp dir; --verbose: to the
terminal). Exit status: 1 when a test failed or timed out that --expect-fail does not list.

--expect-fail FILE: one `test_name  # reason` a line (blank and `#` lines ignored): a
listed test that fails or times out is XFAIL and not counted as failed; one that passes is
reported as XPASS (an unexpected pass: take it off the list).

Needs torch's test helpers' own dependency `expecttest` (pip install expecttest).
"""

import argparse
import os
import re
import sys
import tempfile
import time
import traceback
import unittest

# ---------------------------------------------------------------------------------------
# The selection: regexes (re.fullmatch against the test's name) of _DistTestBase tests that
# run on CPU tensors and exercise what gradwire offers.
SELECTION = [
    # process group basics, new_group / destroy
    r"test_get_rank", r"test_get_backend", r"test_Backend_enum_class",
    r"test_get_rank_size_(group|full_group)", r"test_destroy_(group|full_group)",
    r"test_dump_DDP_relevant_env_vars",
    # barrier, and timeouts (a barrier only rank 0 enters must time out)
    r"test_barrier(_group|_full_group)?",
    r"test_barrier_timeout_(global|group|full_group)",
    # point to point: send/recv (plain, with tags, from any source), isend/irecv,
    # batch_isend_irecv (with tags), and the autograd profiler's record of them
    r"test_send_recv(_with_tag|_any_source)?(_autograd_profiler)?",
    r"test_isend(_autograd_profiler)?", r"test_irecv",
    r"test_batch_isend_irecv_gloo(_tags)?",
    # broadcast, reduce, all-reduce (every op, async, complex, subgroups)
    r"test_broadcast(_group|_full_group)?",
    r"test_reduce_(sum|product|min|max)", r"test_reduce_sum_twice",
    r"test_reduce_(group|full_group)_(sum|product|min|max)",
    r"test_all_reduce_(sum|product|min|max)", r"test_all_reduce_sum_(async|complex)",
    r"test_all_reduce_complex_unsupported_ops",
    r"test_all_reduce_(group|full_group)_(sum|product|min|max)",
    # coalesced all-reduce (torch's all_reduce_coalesced)
    r"test_all_reduce_coalesced_(sum|product|min|max)",
    r"test_all_reduce_coalesced_(group|full_group)_(sum|product|min|max)",
    r"test_all_reduce_coalesced_max_complex_unsupported",
    # scatter / gather and their argument checks
    r"test_scatter(_checks|_complex|_group|_full_group)?",
    r"test_gather(_checks|_group|_full_group)?",
    # all_gather, all_gather_coalesced
    r"test_all_gather(_complex|_group|_full_group)?",
    r"test_all_gather_coalesced_(simple|complex|group|full_group|with_empty)",
    # all-to-all, list and single-tensor forms, even and uneven splits
    r"test_all_to_all(_complex|_group|_full_group)?",
    r"test_all_to_all_single_(equal|unequal)_split(_complex|_group|_full_group)?",
    # object collectives (pickled through broadcast / all_gather / scatter)
    r"test_all_gather_object_(default_pg|subgroup)", r"test_gather_object(_subgroup)?",
    r"test_scatter_object_list",
    # monitored_barrier
    r"test_monitored_barrier_gloo(_subgroup|_rank_0_timeout)?",
    r"test_monitored_barrier_(failure_order|wait_all_ranks)",
    # DDP on CPU models: training vs. a local model, no_sync accumulation, comm hooks'
    # futures, static graph, create_graph, logging
    r"test_DistributedDataParallelCPU(_grad_is_view)?",
    r"test_DistributedDataParallel_requires_grad",
    r"test_accumulate_gradients_no_sync(_grad_is_view|_allreduce_hook|_allreduce_with_then_hook)?",
    r"test_get_future", r"test_grads_same_across_ranks_with_no_sync",
    r"test_ddp_create_graph", r"test_ddp_logging_data_cpu", r"test_static_graph_api_cpu",
]

# Tests torch marks skipped for every backend but one named one, although they are CPU
# tests of calls gradwire offers: name -> torch's skip reason (regex) that may be cleared.
_GLOO_ONLY = r"Test requires backend gradwire to be one of \{'gloo'\}"
UNLOCK = {
    "test_barrier_timeout_global": r"Only gloo backend supports timeouts",
    "test_barrier_timeout_group": r"Only gloo backend supports timeouts",
    "test_barrier_timeout_full_group": r"Only gloo backend supports timeouts",
    "test_batch_isend_irecv_gloo": r"GLOO Batch Send Recv CPU",
    "test_batch_isend_irecv_gloo_tags": r"GLOO Batch Send Recv CPU",
    **{f"test_all_reduce_coalesced_{g}{op}": _GLOO_ONLY
       for g in ("", "group_", "full_group_") for op in ("sum", "product", "min", "max")},
    "test_monitored_barrier_gloo": _GLOO_ONLY,
    "test_monitored_barrier_gloo_subgroup": _GLOO_ONLY,
    "test_monitored_barrier_gloo_rank_0_timeout": _GLOO_ONLY,
    "test_monitored_barrier_failure_order": _GLOO_ONLY,
    "test_monitored_barrier_wait_all_ranks": _GLOO_ONLY,
    "test_scatter_object_list": _GLOO_ONLY,
    "test_grads_same_across_ranks_with_no_sync": _GLOO_ONLY,
    # (not test_accumulate_gradients_no_sync*: under the same skip, but their body builds
    # the model only for mpi, gloo and nccl, so on any other backend they cannot run)
    "test_get_future": r"get_future is only supported on mpi, nccl and gloo",
    **{f"test_all_to_all{s}": r"Only MPI supports all_to_all"
       for s in ("", "_complex", "_group", "_full_group")},
    **{f"test_all_to_all_single_{k}_split{s}": r"Only MPI supports CPU all_to_all_single"
       for k in ("equal", "unequal") for s in ("", "_complex", "_group", "_full_group")},
}

# Features of gradwire that torch's tables name (see the module's docstring).
GRADWIRE_FEATURES = ("plugin", "subgroup", "ddp", "gpu")


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True, help='"gradwire" or "gloo"')
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--only", metavar="REGEX", help="run only the selected tests whose name this regex finds")
    p.add_argument("--all", action="store_true", help="start from every _DistTestBase test, not the selection")
    p.add_argument("--list", action="store_true", help="list the tests that would run, and exit")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per test (default 60)")
    p.add_argument("--expect-fail", metavar="FILE", help="known failures: `name  # reason` a line")
    p.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                   help="how rank processes start (spawn: as test_distributed_spawn.py; fork: faster)")
    p.add_argument("--log", metavar="FILE", help="where the ranks' output goes (default: a file in the temp dir)")
    p.add_argument("--verbose", action="store_true", help="leave the ranks' output on the terminal")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
# Environment torch's test base reads at import. The runner sets it; rank processes inherit it.
if __name__ == "__main__":
    ARGS = _parse_args(sys.argv[1:])
    if ARGS.world_size < 2:
        sys.exit("--world-size: at least 2")
    _tmp = tempfile.mkdtemp(prefix="torch_dist_suite_")
    os.makedirs(os.path.join(_tmp, "barrier"), exist_ok=True)
    os.environ["BACKEND"] = ARGS.backend
    os.environ["WORLD_SIZE"] = str(ARGS.world_size)
    os.environ["TEMP_DIR"] = _tmp
    # file:// as torch's CI runs it (test_barrier_timeout_global requires it); each test
    # gets its own file (TestDistBackend.setUp).
    os.environ["INIT_METHOD"] = "file://" + os.path.join(_tmp, "init_file")
    # No "to execute this test, run ..." trailer after each rank's traceback.
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
else:
    ARGS = None
    for _var in ("BACKEND", "WORLD_SIZE", "TEMP_DIR"):
        if _var not in os.environ:
            raise RuntimeError(f"{__file__}: run it as a script (environment variable {_var} not set)")

BACKEND = os.environ["BACKEND"]

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401  (before the test helpers, as torch imports it)

if BACKEND == "gradwire":
    import gradwire.torch  # noqa: E402,F401  (registers the "gradwire" backend, in every rank too)

try:
    from torch.testing._internal import common_distributed  # noqa: E402
except ModuleNotFoundError as e:  # expecttest, which torch's test helpers import
    sys.exit(f"torch's test helpers need {e.name}: pip install {e.name}")

if BACKEND not in ("gloo", "nccl", "mpi", "ucc"):
    # A backend torch's tables do not know: declare its features before the test base is
    # imported (its decorators read the tables then).
    for _feature in GRADWIRE_FEATURES:
        common_distributed.DistTestCases.backend_feature[_feature].add(BACKEND)

from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

_BASE = DistributedTest._DistTestBase
UNLOCKED = []  # (name, the reason torch gave) for the tests whose skip mark was cleared
if BACKEND == "gradwire":
    for _name, _reason in UNLOCK.items():
        _fn = _BASE.__dict__.get(_name)
        _why = getattr(_fn, "__unittest_skip_why__", "")
        if _fn is not None and getattr(_fn, "__unittest_skip__", False) and re.fullmatch(_reason, _why):
            _fn.__unittest_skip__ = False
            del _fn.__unittest_skip_why__
            UNLOCKED.append((_name, _why))


class SuiteTimeout(Exception):
    """A test's ranks did not finish within the runner's limit."""


_SMALL_WORLDSIZE_CODE = common_distributed.skip_if_small_worldsize(lambda: None).__code__


def _needs_eight_ranks(fn):
    """Whether torch's skip_if_small_worldsize wraps `fn` (a skip below 8 ranks, but mpi)."""
    while fn is not None:
        if getattr(fn, "__code__", None) is _SMALL_WORLDSIZE_CODE:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


class _SuiteBackend(TestDistBackend, _BASE):
    """TestDistBackend + _DistTestBase, as test_distributed_spawn.py makes them, with the
    runner's per-test limit in place of torch's (300 s) and its ranks started by spawn
    (or fork)."""

    limit_s = 60.0
    start_method = "spawn"

    def setUp(self):
        super().setUp()  # a fresh TEMP_DIR / INIT_METHOD for this test
        distributed_test.INIT_METHOD = os.environ["INIT_METHOD"]  # what a forked rank reads
        if self.start_method == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()

    def _join_processes(self, fn):
        start = time.time()
        try:
            while True:
                codes = [p.exitcode for p in self.processes]
                if MultiProcessTestCase.TEST_ERROR_EXIT_CODE in codes:
                    break  # a rank failed: the others would wait for it
                if all(c is not None for c in codes):
                    break
                if time.time() - start > self.limit_s:
                    self._get_timedout_process_traceback()  # into the log
                    self._stop_ranks()
                    raise SuiteTimeout(f"no result after {self.limit_s:.0f} s (ranks killed)")
                time.sleep(0.05)
            self._stop_ranks()
            self._check_return_codes(fn, time.time() - start)
        finally:
            for pipe in self.pid_to_pipe.values():
                pipe.close()

    def _stop_ranks(self):
        for p in self.processes:
            if p.exitcode is None:
                p.terminate()
        for p in self.processes:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join(5)


MultiProcessTestCase = common_distributed.MultiProcessTestCase

# One class per backend, named as test_distributed_spawn.py names it; found by name in the
# rank processes.
_SuiteBackend.__name__ = _SuiteBackend.__qualname__ = f"TestDistBackendWithSpawn{BACKEND.upper()}"
globals()[_SuiteBackend.__name__] = _SuiteBackend


# ---------------------------------------------------------------------------------------
# The runner (the script only; rank processes stop above).
def _all_tests():
    return sorted(n for n in dir(_BASE) if n.startswith("test_") and callable(getattr(_BASE, n)))


def _selected(args):
    names = _all_tests()
    if not args.all:
        pats = [re.compile(p) for p in SELECTION]
        names = [n for n in names if any(p.fullmatch(n) for p in pats)]
    if args.only:
        only = re.compile(args.only)
        names = [n for n in names if only.search(n)]
    return names


def _skip_before_start(name):
    """The reason a test is skipped without starting ranks, or None."""
    fn = getattr(_BASE, name)
    if getattr(fn, "__unittest_skip__", False):
        return getattr(fn, "__unittest_skip_why__", "skipped")
    if BACKEND != "mpi" and int(os.environ["WORLD_SIZE"]) < 8 and _needs_eight_ranks(fn):
        return common_distributed.TEST_SKIPS["small_worldsize"].message
    return None


def _read_expect_fail(path):
    known = {}
    with open(path) as f:
        for line in f:
            body, _, reason = line.partition("#")
            name = body.strip()
            if name:
                known[name] = reason.strip()
    return known


def _last_line(text):
    """The last line of an error; for errors of the ranks, each failing rank's last line."""
    blocks = re.split(r"Process (\d+) exited with error code \d+ and exception:\n", text)
    if len(blocks) > 1:
        lines = []
        for rank, block in zip(blocks[1::2], blocks[2::2]):
            tail = [ln.strip() for ln in block.splitlines() if ln.strip() and not _REPRO.search(ln)]
            if tail:
                lines.append(f"rank {rank}: {tail[-1]}")
        if lines:
            return " | ".join(lines)
    tail = [ln.strip() for ln in text.splitlines() if ln.strip() and not _REPRO.search(ln)]
    return tail[-1] if tail else "(no message)"


# torch's trailer after a test's traceback (when PYTORCH_PRINT_REPRO_ON_FAILURE is not 0)
_REPRO = re.compile(r"^(To execute this test, run the following|\s*PYTORCH_TEST_|This message can be suppressed|\s*python .*\.py )")


class _Result(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcome, self.detail = "PASS", ""

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        if err[0] is SuiteTimeout:
            self.outcome, self.detail = "TIMEOUT", str(err[1])
        else:
            self.outcome, self.detail = "FAIL", _last_line("".join(traceback.format_exception_only(err[0], err[1])))

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self.outcome, self.detail = "FAIL", _last_line("".join(traceback.format_exception_only(err[0], err[1])))

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self.outcome, self.detail = "SKIP", str(reason)


def main(args):
    names = _selected(args)
    known = _read_expect_fail(args.expect_fail) if args.expect_fail else {}
    out = sys.stdout
    if args.list:
        for name in names:
            why = _skip_before_start(name)
            mark = " (expected to fail)" if name in known else ""
            mark += "".join(f"  [torch's skip cleared: {w}]" for n, w in UNLOCKED if n == name)
            out.write(f"{name}{mark}" + (f"  [skip: {why}]" if why else "") + "\n")
        out.write(f"{len(names)} tests selected for {BACKEND} ws{os.environ['WORLD_SIZE']}\n")
        return 0

    _SuiteBackend.limit_s = args.timeout
    _SuiteBackend.start_method = args.start_method
    log_path = args.log or os.path.join(os.environ["TEMP_DIR"], "ranks.log")
    out.write(f"torch dist suite: {BACKEND}, {os.environ['WORLD_SIZE']} ranks, {len(names)} tests, "
              f"{args.timeout:.0f} s each at most, ranks by {args.start_method}; "
              f"ranks' output: {'terminal' if args.verbose else log_path}\n")
    cleared = [name for name, _ in UNLOCKED if name in names]
    if cleared:
        out.write(f"  torch's skip mark cleared for {BACKEND} on {len(cleared)} of them (UNLOCK; --list names them)\n")
    out.flush()

    # The ranks inherit fds 1 and 2: point them at the log; the runner's lines go to a copy
    # of the terminal's stdout.
    if not args.verbose:
        term = os.fdopen(os.dup(1), "w", buffering=1)
        log = open(log_path, "a", buffering=1)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        out = term

    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0, "TIMEOUT": 0, "XFAIL": 0, "XPASS": 0}
    started = time.time()
    for name in names:
        print(f"===== {name}", flush=True)  # into the log, to find a test's output
        t0 = time.time()
        why = _skip_before_start(name)
        if why is not None:
            outcome, detail = "SKIP", why
        else:
            result = _Result()
            _SuiteBackend(name).run(result)
            outcome, detail = result.outcome, result.detail
            if outcome in ("FAIL", "TIMEOUT") and not args.verbose:
                for _, text in result.errors + result.failures:
                    print(text, flush=True)
        took = time.time() - t0
        if name in known and outcome in ("FAIL", "TIMEOUT"):
            outcome, detail = "XFAIL", f"{outcome.lower()}: {detail}  # {known[name]}"
        elif name in known and outcome == "PASS":
            outcome, detail = "XPASS", f"passed, but listed in {args.expect_fail} ({known[name]})"
        counts[outcome] += 1
        line = f"{outcome:<7} {name}  ({took:.1f} s)"
        if outcome != "PASS":
            line += f": {detail}"
        out.write(line + "\n")
        out.flush()

    failed = counts["FAIL"] + counts["TIMEOUT"]
    passed = counts["PASS"] + counts["XPASS"]
    extra = [f"{counts['TIMEOUT']} timed out (counted as failed)"] if counts["TIMEOUT"] else []
    if known:
        extra.append(f"{counts['XFAIL']} expected failures (not counted)")
        extra.append(f"{counts['XPASS']} unexpected passes")
    if extra:
        out.write("  " + ", ".join(extra) + "\n")
    out.write(f"  {time.time() - started:.0f} s in all\n")
    out.write(f"torch dist suite {BACKEND} ws{os.environ['WORLD_SIZE']}: "
              f"{passed} passed, {failed} failed, {counts['SKIP']} skipped\n")
    out.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
