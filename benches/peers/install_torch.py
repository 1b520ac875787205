#!/usr/bin/env python3
"""install_torch.py -- install a torch that imports on a CPU-only machine.

PyPI's Linux torch wheel is the CUDA build: `import torch` needs the CUDA
runtime libraries it links against, even with no GPU.  `pip install torch`
works but pulls ~3 GB (triton, cusolver, curand, ...).  This installs the
smaller set that is enough for CPU tensors and the Gloo backend (~1.9 GB):

  1. pip install --no-deps torch[==VERSION]
  2. torch's pure-python requirements (filelock, sympy, networkx, ...)
  3. --no-deps, at the versions torch's own metadata pins: the nvidia-*
     wheels whose libraries libtorch_cpu/libtorch_cuda link against
     (cudart, cublas, cudnn, nvrtc, cupti, cufft, curand, nvjitlink, cusparse,
     cusparselt, nccl, nvshmem, cufile).  Newer torch pins them through the
     `cuda-toolkit[...]==X` meta-package; its extras are resolved from that
     package's METADATA.
  4. `import torch`; if that still fails, falls back to `pip install torch`.

Idempotent: does nothing if `import torch` already works.
Usage: python3 benches/peers/install_torch.py [--version 2.x.y] [--target DIR]

--target DIR installs torch and its CUDA libraries into DIR alone (a second torch beside
the environment's, used with PYTHONPATH=DIR); its pure-python requirements come from the
environment.
"""
import argparse
import glob
import importlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile

# cuda-toolkit extras / nvidia packages not needed to import torch on a CPU box (torch
# 2.11 links curand, 2.15 does not)
SKIP = {"cusolver", "nvtx", "tileiras", "all"}
PIP = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]


def sh(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.check_call(cmd)


def torch_imports(target=None) -> bool:
    env = dict(os.environ, PYTHONPATH=target) if target else None
    code = "import torch, torch.distributed as d; assert d.is_gloo_available()"
    if target:  # the torch in target, not the environment's
        code += f"; assert torch.__file__.startswith({target!r}), torch.__file__"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(r.stderr.strip().splitlines()[-1:] or "", flush=True)
    return r.returncode == 0


def split_req(req: str):
    """'name[extras]==1.2; marker' -> (name, [extras], spec, marker)."""
    body, _, marker = req.partition(";")
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(\[[^\]]*\])?\s*(.*)", body)
    name, extras, spec = m.group(1), m.group(2), m.group(3).strip()
    extras = [e.strip() for e in extras[1:-1].split(",")] if extras else []
    return name, extras, spec, marker.strip()


def marker_ok(marker: str) -> bool:
    if not marker:
        return True
    if "extra ==" in marker:
        return False
    try:
        from packaging.markers import Marker  # shipped with pip/setuptools
    except ImportError:
        from pip._vendor.packaging.markers import Marker
    return Marker(marker).evaluate()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default=None, help="torch version (default: latest)")
    ap.add_argument("--target", default=None, help="install into this directory alone")
    args = ap.parse_args()
    target = os.path.abspath(args.target) if args.target else None
    pip = PIP + (["--target", target, "--upgrade"] if target else [])

    if torch_imports(target):
        print("torch already importable; nothing to do")
        return 0

    sh(pip + ["--no-deps", "torch" + (f"=={args.version}" if args.version else "")])
    importlib.invalidate_caches()
    from importlib import metadata
    if target:
        reqs = next(metadata.distributions(name="torch", path=[target])).requires or []
    else:
        reqs = metadata.requires("torch") or []

    plain, nvidia = [], []
    for req in reqs:
        name, extras, spec, marker = split_req(req)
        if not marker_ok(marker):
            continue
        low = name.lower()
        if low == "cuda-toolkit":
            with tempfile.TemporaryDirectory() as d:
                sh([sys.executable, "-m", "pip", "download", "--no-deps", "-d", d,
                    f"cuda-toolkit{spec}"])
                whl = glob.glob(f"{d}/*.whl")[0]
                with zipfile.ZipFile(whl) as z:
                    meta = z.read(next(n for n in z.namelist()
                                       if n.endswith(".dist-info/METADATA"))).decode()
            wanted = [e for e in extras if e not in SKIP]
            for line in meta.splitlines():
                if not line.startswith("Requires-Dist:"):
                    continue
                r = line.split(":", 1)[1].strip()
                n2, _, s2, m2 = split_req(r)
                em = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", m2)
                if em and em.group(1) in wanted:
                    nvidia.append(f"{n2}{s2}")
        elif low.startswith("nvidia-"):
            if not any(s in low for s in SKIP):
                nvidia.append(f"{name}{spec}")
        elif low in ("triton", "cuda-bindings"):
            continue  # GPU compiler / python CUDA bindings: not needed on CPU
        else:
            plain.append(f"{name}{spec}")

    nvidia = sorted(set(nvidia))
    if plain and not target:
        sh(pip + plain)
    if nvidia:
        sh(pip + ["--no-deps"] + nvidia)

    if torch_imports(target):
        print("torch importable (reduced CUDA runtime set)")
        return 0
    if target:
        return 1
    print("reduced install not enough; falling back to full `pip install torch`", flush=True)
    sh(PIP + ["torch" + (f"=={args.version}" if args.version else "")])
    return 0 if torch_imports() else 1


if __name__ == "__main__":
    sys.exit(main())
