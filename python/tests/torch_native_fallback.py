"""One rank (world 1) of tests/python.rs's check that the torch backend explains itself where
its C++ part cannot be had:

    torch_native_fallback.py no-compiler   CXX is /bin/false, the cache empty: one warning
                                           saying why, then the Python group, which works
    torch_native_fallback.py off           GRADWIRE_TORCH_NATIVE=0: the Python group, no warning
    torch_native_fallback.py bad-setting   GRADWIRE_TORCH_NATIVE or _WAIT_S malformed (the test
                                           sets one): init_process_group raises ValueError
                                           naming it

Prints "fallback: ok" when what it saw is what the mode expects.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist

import gradwire.torch  # noqa: F401

mode = sys.argv[1]
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    try:
        dist.init_process_group("gradwire")
    except ValueError as e:
        named = [k for k in ("GRADWIRE_TORCH_NATIVE=", "GRADWIRE_TORCH_NATIVE_WAIT_S=") if k in str(e)]
        assert mode == "bad-setting" and named, f"{mode}: init_process_group raised {e!r}"
        print(f"fallback: ok ({e})")
        sys.exit(0)
assert mode != "bad-setting", "a malformed setting was accepted"
ours = [str(w.message) for w in seen if "C++ hot path" in str(w.message)]
group = dist.group.WORLD
assert not type(group)._native, "the C++ path is in use"
if mode == "no-compiler":
    assert len(ours) == 1 and "false" in ours[0], f"expected one warning naming the failed compiler, got {ours}"
else:
    assert not ours, f"GRADWIRE_TORCH_NATIVE=0 warned: {ours}"
x = torch.arange(8, dtype=torch.float32)
dist.all_reduce(x)
out = torch.empty(8)
dist.all_gather_into_tensor(out, x)
assert torch.equal(out, torch.arange(8, dtype=torch.float32)), out
dist.destroy_process_group()
print(f"fallback: ok ({ours[0] if ours else 'no warning'})")
