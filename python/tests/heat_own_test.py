"""Heat's own DASO test (`tests/optim/test_dp_optimizer.py` of Heat's repository; no PyPI
release of Heat ships its tests) run against `gradwire.heat`, under `gradwire launch -n 8
--netns --ranks-per-node 4` (Heat wrote it for 2 nodes of 4 GPUs):

    heat_own_test.py PATH_TO/test_dp_optimizer.py

The file is read, not copied into this repository, and changed only as listed in ADAPT:
the imports (`heat` becomes `gradwire.heat`; Heat's TestCase, which needs Heat's MPI
arrays, becomes `unittest.TestCase` with the one class method the test asks of it), and
what names CUDA and NCCL (the device becomes the CPU, NCCL's process group gloo's, CUDA's
autocast and GradScaler the CPU's). Every change must match the file exactly once, so a
new version of Heat's test fails here loudly rather than running changed. Heat's test
also calls one private method of Heat's implementation (`_gs_rcv_update_params_last_batch`
with `_prev_params` set by hand): that check is left out, and said so in the output.
Prints "heat test: ok" per rank when unittest passes.
"""

import socket
import sys
import types
import unittest

import gradwire.heat as ht

PRIVATE = """        with self.assertRaises(ValueError):
            daso_optimizer._prev_params = [1, 2]
            daso_optimizer._gs_rcv_update_params_last_batch(current_ranks=[0, 4])
"""

ADAPT = [
    # imports
    ("import heat as ht\n", "import gradwire.heat as ht\n"),
    ("from heat.testing.basic_test import TestCase\n", "from heat_own_test import TestCase\n"),
    ("        import heat.nn.functional as F\n", "        import gradwire.heat.nn.functional as F\n"),
    ("        import heat.optim as optim\n", "        import gradwire.heat.optim as optim\n"),
    # what names CUDA: the GPUs of a node are its ranks, the device the CPU
    ("        and torch.cuda.device_count() > 1\n        and TestCase.device == \"cuda\",", "        and TestCase.ranks_per_node() > 1,"),
    ("torch.cuda.device_count() = {torch.cuda.device_count()}, torch.cuda.current_device() = {torch.cuda.current_device()}", "ranks per node = {TestCase.ranks_per_node()}, device = cpu"),
    ("torch.cuda.device_count() = {torch.cuda.device_count()}, rank", "ranks per node = {TestCase.ranks_per_node()}, rank"),
    ("                    with torch.cuda.amp.autocast():\n", "                    with torch.autocast(\"cpu\", dtype=torch.bfloat16):\n"),
    ("        gpus = torch.cuda.device_count()\n", "        gpus = TestCase.ranks_per_node()\n"),
    ("        device = f\"cuda:{str(loc_rank)}\"\n", "        device = \"cpu\"\n"),
    ("        os.environ[\"NCCL_SOCKET_IFNAME\"] = \"ib\"\n", ""),
    ("init_process_group(backend=\"nccl\", rank=loc_rank, world_size=gpus)", "init_process_group(backend=\"gloo\", rank=loc_rank, world_size=gpus)"),
    ("        torch.cuda.set_device(device)\n", ""),
    ("        device = torch.device(\"cuda\")\n", "        device = torch.device(\"cpu\")\n"),
    ("        scaler = torch.cuda.amp.GradScaler()\n", "        scaler = torch.amp.GradScaler(\"cpu\")\n"),
    # Heat's private internals (see the module text)
    (PRIVATE, ""),
]


class TestCase(unittest.TestCase):
    """What Heat's test asks of Heat's TestCase, over gradwire's world."""

    _hostnames = None

    @classmethod
    def get_hostnames(cls):
        """One name per node of the job, as gradwire groups the ranks (host identity: a
        namespace node is a host)."""
        if cls._hostnames is None:
            nodes = ht.MPI_WORLD.comm.hierarchy().nodes
            cls._hostnames = [f"{socket.gethostname()}-node{n}" for n in range(nodes)]
        return cls._hostnames

    @classmethod
    def ranks_per_node(cls):
        return ht.MPI_WORLD.size // len(cls.get_hostnames())


def adapted(source):
    for old, new in ADAPT:
        n = source.count(old)
        if n != 1:
            raise SystemExit(f"heat_own_test.py: Heat's test has changed: {old!r} occurs {n} times, not once")
        source = source.replace(old, new)
    return source


def main():
    path = sys.argv[1]
    with open(path) as f:
        code = compile(adapted(f.read()), path + " (adapted)", "exec")
    module = types.ModuleType("test_dp_optimizer")
    module.__file__ = path
    sys.modules["heat_own_test"] = sys.modules[__name__]
    exec(code, module.__dict__)
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=2).run(suite)
    rank = ht.MPI_WORLD.rank
    ran = result.testsRun - len(result.skipped)
    if rank == 0:
        print("heat test: left out: Heat's private _gs_rcv_update_params_last_batch check", flush=True)
    ok = result.wasSuccessful() and ran > 0
    print(f"rank {rank}: heat test: {'ok' if ok else 'FAILED'} ({ran} run, {len(result.skipped)} skipped)", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
