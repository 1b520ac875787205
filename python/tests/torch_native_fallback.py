"""One rank (world 1) of tests/python.rs's check that the torch backend explains itself where
it cannot be built:

    torch_native_fallback.py no-compiler   CXX is /bin/false, the cache empty:
                                           init_process_group raises RuntimeError saying
                                           the backend cannot be built, naming the compiler
    torch_native_fallback.py bad-setting   GRADWIRE_TORCH_NATIVE_WAIT_S malformed:
                                           init_process_group raises ValueError naming it

Prints "fallback: ok" when what it saw is what the mode expects.
"""

import sys

import torch.distributed as dist

import gradwire.torch  # noqa: F401

mode = sys.argv[1]
try:
    dist.init_process_group("gradwire")
except ValueError as e:
    assert mode == "bad-setting" and "GRADWIRE_TORCH_NATIVE_WAIT_S=" in str(e), f"{mode}: init_process_group raised {e!r}"
    print(f"fallback: ok ({e})")
    sys.exit(0)
except RuntimeError as e:
    assert mode == "no-compiler" and "cannot be built" in str(e) and "false" in str(e), f"{mode}: init_process_group raised {e!r}"
    print(f"fallback: ok ({e})")
    sys.exit(0)
raise AssertionError(f"{mode}: init_process_group succeeded")
