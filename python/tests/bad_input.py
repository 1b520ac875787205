"""Run under `gradwire launch -n N -- python3 python/tests/bad_input.py`.

Integers that cross ctypes are checked in Python first: ctypes wraps one that does not fit
the C type, so broadcast(root=2**40) was a broadcast from root 0 and split(2**31) a split
with a negative colour (None). Every rank makes the same bad calls, so a call that did reach
C would still be the same collective everywhere (no hang, only a wrong result). After the
bad calls the communicator must still give right answers.
"""

import sys

import numpy as np

from gradwire import Comm, UnsupportedError

comm = Comm()
rank, world = comm.rank, comm.size
failures = []
cases = 0


def check(name, ok, detail=""):
    global cases
    cases += 1
    if not ok:
        failures.append(f"rank {rank}: {name}{': ' + detail if detail else ''}")


def rejects(name, call, exc, *in_message):
    """`call()` must raise `exc` before reaching C, with every string of `in_message` in its text."""
    try:
        got = call()
    except exc as e:
        missing = [m for m in in_message if m not in str(e)]
        check(name, not missing, f"message {str(e)!r} lacks {missing}")
    except Exception as e:  # noqa: BLE001 (a wrong kind of error is a failure, not a crash)
        check(name, False, f"raised {type(e).__name__}: {e}")
    else:
        check(name, False, f"accepted, returned {got!r}")


def sum_works(name):
    """A real allreduce: Σ (r + 1) over the ranks."""
    x = np.full(1000, rank + 1, dtype=np.float64)
    comm.allreduce(x)
    check(name, bool(np.all(x == world * (world + 1) / 2)), f"got {x[0]}")


def broadcast_works(name, root):
    b = np.arange(257, dtype=np.float32) + 1000 * rank
    comm.broadcast(b, root=root)
    want = np.arange(257, dtype=np.float32) + 1000 * int(root)
    check(name, bool(np.array_equal(b, want)), f"got [0] = {b[0]}, want {want[0]}")


buf = np.zeros(16, dtype=np.float32)
rejects("broadcast root=2**40", lambda: comm.broadcast(buf, root=2**40), ValueError, str(2**40), f"size {world}")
rejects("broadcast root=-1", lambda: comm.broadcast(buf, root=-1), ValueError, "root -1", f"size {world}")
rejects("broadcast root=size", lambda: comm.broadcast(buf, root=world), ValueError, f"root {world} is not a rank of this communicator (size {world})")
rejects("broadcast root=True", lambda: comm.broadcast(buf, root=True), TypeError, "root", "bool")
rejects("broadcast root=1.5", lambda: comm.broadcast(buf, root=1.5), TypeError, "root", "1.5")
rejects("broadcast root='0'", lambda: comm.broadcast(buf, root="0"), TypeError, "root", "str")
sum_works("allreduce after bad broadcasts")

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
rejects("split(2**31)", lambda: comm.split(2**31), ValueError, "color", str(2**31), str(INT_MAX))
rejects("split(-2**31-1)", lambda: comm.split(INT_MIN - 1), ValueError, "color", str(INT_MIN - 1), str(INT_MIN))
rejects("split(0, key=2**31)", lambda: comm.split(0, key=2**31), ValueError, "key", str(2**31))
rejects("split(0, key=-2**31-1)", lambda: comm.split(0, key=INT_MIN - 1), ValueError, "key", str(INT_MIN - 1))
rejects("split(1.5)", lambda: comm.split(1.5), TypeError, "color")
rejects("split(False)", lambda: comm.split(False), TypeError, "color", "bool")
sum_works("allreduce after bad splits")
# The ends of the C int range are valid: the largest colour for half the ranks, the most
# negative (join no group) for the rest, with the smallest key.
sub = comm.split(INT_MAX if rank % 2 == 0 else INT_MIN, key=INT_MIN)
if rank % 2 == 0:
    check("split(2**31-1) size", sub is not None and sub.size == (world + 1) // 2 and sub.rank == rank // 2,
          f"got {None if sub is None else (sub.rank, sub.size)}")
    if sub is not None:
        sub.finalize()
else:
    check("split(-2**31) is None", sub is None, f"got a communicator of size {getattr(sub, 'size', '?')}")

x = np.full(4096, rank + 1, dtype=np.float64)
work = comm.iallreduce(x)
rejects("wait(timeout_ms=2**63)", lambda: work.wait(2**63), ValueError, "timeout_ms", str(2**63))
rejects("wait(timeout_ms=-2**63-1)", lambda: work.wait(-(2**63) - 1), ValueError, "timeout_ms", str(-(2**63) - 1))
rejects("wait(timeout_ms=0.5)", lambda: work.wait(0.5), TypeError, "timeout_ms", "float")
rejects("wait(timeout_ms=True)", lambda: work.wait(True), TypeError, "timeout_ms", "bool")
try:  # the rejected waits left the work valid
    got = work.wait()
    check("wait after bad timeouts", got is x and bool(np.all(x == world * (world + 1) / 2)), f"got {x[0]}")
except Exception as e:  # noqa: BLE001
    check("wait after bad timeouts", False, f"raised {type(e).__name__}: {e}")

rejects("empty(-1)", lambda: comm.empty(-1), ValueError, "count -1")
rejects("empty(2**64)", lambda: comm.empty(2**64), ValueError, "count", str(2**64))
# 2**62 float32 elements are 2**64 bytes: the count fits a size_t, its bytes do not.
rejects("empty(2**62, float32)", lambda: comm.empty(2**62, "float32"), ValueError, "count", str(2**62))
rejects("empty(1.5)", lambda: comm.empty(1.5), TypeError, "count", "float")
rejects("empty('3')", lambda: comm.empty("3"), TypeError, "count", "str")
rejects("empty(True)", lambda: comm.empty(True), TypeError, "count", "bool")
e = comm.empty(np.int64(5), "float64")  # NumPy integers are integers
check("empty(np.int64(5))", e.shape == (5,) and e.dtype == np.float64, f"got {e.shape} {e.dtype}")
del e

# The GPU communicator: a bad device is refused in Python; on a machine without a GPU the
# library's reason (what was searched) comes back as UnsupportedError on every rank, and
# on one GPU the ranks of this one node, all on device 0, are refused by name.
rejects("gpu(-1)", lambda: comm.gpu(-1), ValueError, "device -1")
rejects("gpu('0')", lambda: comm.gpu("0"), TypeError, "device", "str")
try:
    gpu = comm.gpu(0)
except UnsupportedError as e:
    if "both chose the same GPU" in str(e):
        check("gpu(0) of every rank on one GPU names the pair", world > 1 and "ranks 0 and 1 of one node" in str(e), str(e))
    else:
        check("gpu(0) without a GPU says why", "searched" in str(e) or "no GPU" in str(e) or "NCCL" in str(e), str(e))
else:
    rejects("gpu allreduce of a NumPy array", lambda: gpu.allreduce(buf), ValueError, "expected a CUDA tensor")
    gpu.free()

sum_works("allreduce after all bad input")
broadcast_works("broadcast from the last rank", world - 1)
broadcast_works("broadcast from root np.int64(0)", np.int64(0))
comm.finalize()

for f in failures:
    print("FAIL", f, file=sys.stderr)
print(f"rank {rank}: bad input: {cases - len(failures)} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
