"""The PyTorch-level fault matrix: rank 1 is SIGKILLed or SIGSTOPped while the ranks train
under DDP (with and without a communication hook), wait on async collectives out of order,
or step one of gradwire's scheme optimizers (DASO, BSP, ParameterServer), with 2 and 3
ranks, started as plain processes, under torchrun and under `gradwire launch`
(python/tests/fault_rank.py is one rank). The same script on gloo runs beside it, for
comparison (reported, not judged; `--no-gloo` leaves it out, as the test suite does).

    fault_matrix.py [--loops N] [--jobs J] [--only SUBSTRING] [--deadline-s S] [--margin-s S] [--no-gloo]

Needs GRADWIRE_LIB (libgradwire.so) and, for the launch cases, GRADWIRE_BIN (the gradwire
command) in the environment, and the package on PYTHONPATH. What each case must show:

- plain processes: every survivor raises an error naming rank 1 (PeerLostError, or
  TimeoutError for a stopped rank) within the deadline plus the margin of the fault, and
  exits on its own; none dies of a signal.
- torchrun: torchrun ends within the deadline plus the margin (plus its teardown); the
  lost rank is named, by a survivor's error or by torchrun's report; no rank crashes.
- gradwire launch: it names rank 1 and ends within the same time; no rank crashes.

A stopped rank is killed by this driver once the survivors have reported (an operator
would; torchrun would wait 30 s for it to take SIGTERM). A case in which a rank failed
before the fault (a deadline passed while a loaded machine held a rank back) did not test
the fault: it runs once more, and its line says why. Prints one line per case and exits 1
if any case failed.
"""

import argparse
import concurrent.futures
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_SCRIPT = os.path.join(HERE, "fault_rank.py")
SCENARIOS = ("ddp", "ddp_hook", "async", "daso", "bsp", "ps")
VICTIM = 1
START_LIMIT_S = 240  # start-up to the fault (a fresh cache builds the C++ part first)
CRASH = re.compile(r"Segmentation fault|SIGSEGV|Signal 11|SIGABRT|Signal 6|core dumped|Fatal Python error")


def cases(gloo=True):
    """(launcher, scenario, fault, world, backend) of the whole matrix."""
    out = [("plain", s, f, w, "gradwire") for s in SCENARIOS for f in ("kill", "stop") for w in (2, 3)]
    # Each launcher runs every scenario once; between them both faults and both sizes.
    for i, s in enumerate(SCENARIOS):
        fault, world = ("kill", "stop")[i % 2], (3, 2, 2, 3, 3, 2)[i]
        out.append(("torchrun", s, fault, world, "gradwire"))
        out.append(("launch", s, ("stop", "kill")[i % 2], 5 - world, "gradwire"))
    # torch's own backend on the scenarios it can run (the schemes are gradwire's).
    out += [("plain", s, f, 3, "gloo") for s in ("ddp", "ddp_hook", "async") for f in ("kill", "stop") if gloo]
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(deadline_s):
    env = dict(os.environ)
    env.update(
        GRADWIRE_TIMEOUT_MS=str(int(deadline_s * 1000)),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONUNBUFFERED="1",
        TORCH_CPP_LOG_LEVEL="ERROR",
    )
    return env


def read_fault(where):
    """(pid, wall time) rank 1 wrote just before its fault, or None."""
    try:
        with open(os.path.join(where, "fault")) as f:
            pid, at = f.read().split()
        return int(pid), float(at)
    except (FileNotFoundError, ValueError):
        return None


def caught(where):
    return sum(n.startswith("caught.") for n in os.listdir(where))


def watch(procs, where, world, fault, limit_s):
    """Waits for `procs` (Popen) to end: at most START_LIMIT_S to the fault, then `limit_s`.
    Kills a stopped rank 1 once every survivor has caught its error or `limit_s` has
    passed. Returns (seconds from the fault to the end or None, whether it overran)."""
    start, faulted_mono, stopped_killed = time.monotonic(), None, False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        fault_at = read_fault(where) if faulted_mono is None else None
        if fault_at is not None:
            # The wall time rank 1 wrote, on this host's clock.
            faulted_mono = now - max(0.0, time.time() - fault_at[1])
        if fault == "stop" and faulted_mono is not None and not stopped_killed:
            if caught(where) >= world - 1 or now - faulted_mono > limit_s:
                try:
                    os.kill(read_fault(where)[0], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                stopped_killed = True
        overran = now - start > START_LIMIT_S if faulted_mono is None else now - faulted_mono > limit_s + 30
        if overran:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in procs:
                p.wait()
            return None, True
        time.sleep(0.02)
    return (time.monotonic() - faulted_mono if faulted_mono is not None else None), False


def run_case(launcher, scenario, fault, world, backend, deadline_s, margin_s, retried=None):
    """Runs one case; returns (ok, a line saying what happened). `retried`: why its first
    run did not count."""
    where = tempfile.mkdtemp(prefix="gw-fault-")
    env = base_env(deadline_s)
    port = free_port()
    args = [RANK_SCRIPT, scenario, fault, backend, where]
    logs = [open(os.path.join(where, f"out.{i}"), "w+") for i in range(world if launcher == "plain" else 1)]
    if launcher == "plain":
        procs = []
        for r in range(world):
            renv = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen([sys.executable, *args], env=renv, stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True))
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0", *args]
        procs = [subprocess.Popen(cmd, env=env, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)]
    else:
        cmd = [os.environ["GRADWIRE_BIN"], "launch", "-n", str(world), "--", sys.executable, *args]
        procs = [subprocess.Popen(cmd, env=env, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)]
    limit_s = deadline_s + margin_s
    took, overran = watch(procs, where, world, fault, limit_s)
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    text = "\n".join(texts)
    before = re.findall(r"FAULT-RESULT rank (\d+) failed before the fault: (.*)", text)
    if before and not retried:
        shutil.rmtree(where, ignore_errors=True)
        first = f"rank {before[0][0]} failed before the fault: {before[0][1][:160]}"
        return run_case(launcher, scenario, fault, world, backend, deadline_s, margin_s, retried=first)
    results = re.findall(r"FAULT-RESULT rank (\d+) (caught (\w+) after ([\d.]+) s: (.*)|no error)", text)
    by_rank = {int(r): (kind, float(after) if after else None, msg, whole) for r, whole, kind, after, msg in results}
    name = f"{launcher:8} {backend:8} {scenario:8} {fault:4} {world} ranks"
    seen = "; ".join(f"rank {r}: " + (f"{k} after {a:.2f} s: {m[:110]}" if k else w) for r, (k, a, m, w) in sorted(by_rank.items()))
    took_s = f"{took:.1f} s" if took is not None else "?"
    problems = []
    if before:
        problems.append(f"rank {before[0][0]} failed before the fault: {before[0][1][:200]}")
    if overran:
        problems.append(f"still running {limit_s + 30:.0f} s after the fault (or no fault within {START_LIMIT_S} s): killed")
    if CRASH.search(text):
        problems.append("a rank crashed: " + CRASH.search(text).group(0))
    survivors = [r for r in range(world) if r != VICTIM]
    if backend == "gradwire":
        for r, (kind, after, msg, whole) in by_rank.items():
            if kind and f"rank {VICTIM}" not in msg:
                problems.append(f"rank {r}'s {kind} does not name rank {VICTIM}")
            if kind and after > limit_s:
                problems.append(f"rank {r} raised {after:.2f} s after the fault (limit {limit_s:.0f} s)")
            if not kind:
                problems.append(f"rank {r} trained on: {whole}")
        if launcher == "plain":
            for r, p in zip(range(world), procs):
                if r in survivors and p.returncode != 3:
                    problems.append(f"survivor {r} exited with {p.returncode}, not 3 (caught)")
                if r in survivors and r not in by_rank:
                    problems.append(f"survivor {r} reported nothing")
        else:
            if procs[0].returncode == 0:
                problems.append(f"{launcher} exited 0")
            if took is not None and took > limit_s + (5 if launcher == "torchrun" else 0):
                problems.append(f"{launcher} ended {took:.1f} s after the fault")
            named = any(k for k, _, _, _ in by_rank.values())
            if launcher == "torchrun":
                named = named or re.search(rf"rank\s*:\s*{VICTIM}\b", text) is not None
            else:
                named = named or re.search(rf"rank {VICTIM}\b", text) is not None
            if not named:
                problems.append(f"nobody named rank {VICTIM}")
            if fault == "stop" and launcher == "torchrun" and len([r for r in survivors if r in by_rank]) < len(survivors):
                problems.append("a survivor did not report the stopped rank")
    ok = not problems or backend != "gradwire"
    if ok:
        shutil.rmtree(where, ignore_errors=True)  # a failed case's files stay, for a look
    line = f"{'ok  ' if ok else 'FAIL'} {name}: ended {took_s} after the fault; {seen or 'no rank reported'}"
    if retried:
        line += f" (second run: in the first, {retried})"
    if problems:
        # On the case's own line: a log excerpt that keeps only the FAIL line still says why.
        line += " -- " + ("gloo: " if backend != "gradwire" else "") + "; ".join(problems)
    if not ok:
        line += f"\n       (its files: {where})\n" + "\n".join("       | " + t for t in text.splitlines()[-40:])
    return ok, line


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once")
    ap.add_argument("--only", default="", help="run the cases whose line contains this")
    ap.add_argument("--deadline-s", type=float, default=3.0, help="gradwire's and gloo's deadline")
    ap.add_argument("--margin-s", type=float, default=5.0, help="allowed beyond the deadline")
    ap.add_argument("--no-gloo", action="store_true", help="leave out the gloo cases (they are reported, not judged)")
    a = ap.parse_args()
    chosen = [c for c in cases(gloo=not a.no_gloo) if a.only in " ".join(map(str, c))]
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for loop in range(a.loops):
            runs = [pool.submit(run_case, *case, a.deadline_s, a.margin_s) for case in chosen]
            for run in concurrent.futures.as_completed(runs):
                ok, line = run.result()
                failed += not ok
                print(f"[{loop + 1}/{a.loops}] {line}", flush=True)
    print(f"fault matrix: {len(chosen) * a.loops - failed} of {len(chosen) * a.loops} cases passed ({a.loops} loops of {len(chosen)}; deadline {a.deadline_s:g} s, margin {a.margin_s:g} s)", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
