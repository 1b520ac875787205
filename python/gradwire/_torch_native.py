"""The torch backend's C++ hot path (_torch_group.cpp), built against the torch in use.

torch's C++ ABI changes between releases, so no wheel can carry this extension: it is
compiled at the first gradwire group a process makes (torch.utils.cpp_extension: g++ and
ninja, about 40 s of one core) and cached under ~/.cache/gradwire (XDG_CACHE_HOME; the
temporary directory for a user without a home) by torch build, Python, build flags and
source hash; later processes load it in milliseconds. Ranks
starting together build it once: the others wait on a file lock (flock, which the kernel
releases when its holder dies, so a killed build leaves no stale lock), for at most
GRADWIRE_TORCH_NATIVE_WAIT_S (default 600) seconds before building on their own, and a
build that failed is not tried again for 10 minutes. Each builder compiles in a directory
of its own and moves the result into place.

Where it cannot be built (no compiler, no ninja) the backend is the Python group alone,
with one warning that says why: the same calls, 3.7-5.3 us slower each (one process, a
1-rank group). `GRADWIRE_TORCH_NATIVE=0` chooses that, without a warning.
"""

import contextlib
import fcntl
import hashlib
import importlib.util
import math
import os
import sys
import tempfile
import threading
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "_torch_group.cpp")
_HEADER = os.path.join(_HERE, "gradwire.h")

# How it is compiled (part of the cache key).
_FLAGS = {"extra_cflags": ["-O2"]}

# A failed build is not tried again for this long (the ranks starting with it share it).
_RETRY_S = 600

_lock = threading.Lock()
_loaded = None  # (FastGroup class or None, why not)
_where = None  # the file it was loaded from


def fast_group(retry_failed=False):
    """(the C++ group class, None) or (None, why it is not there); built once per process.
    `retry_failed`: build even if a build failed here within the last 10 minutes."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load(retry_failed)
            if _loaded[0] is None and _loaded[1] is not None:
                warn(_loaded[1])
        return _loaded


def warn(why):
    """The one warning that the backend runs on its Python methods alone, and why."""
    warnings.warn(f"gradwire: the torch backend runs without its C++ hot path ({why}; GRADWIRE_TORCH_NATIVE=0 chooses that quietly)", RuntimeWarning, stacklevel=4)


def _wanted():
    value = os.environ.get("GRADWIRE_TORCH_NATIVE", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"GRADWIRE_TORCH_NATIVE={value!r}: expected 1 (build and use the C++ hot path, the default) or 0 (Python only)")
    return value == "1"


def _wait_s():
    value = os.environ.get("GRADWIRE_TORCH_NATIVE_WAIT_S", "600").strip()
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= 86400:
        raise ValueError(f"GRADWIRE_TORCH_NATIVE_WAIT_S={value!r}: expected seconds to wait for another process's build, 0 to 86400")
    return seconds


def _cache_dir():
    """Where builds go: XDG_CACHE_HOME, else ~/.cache, else (no home: a container user without
    one) the temporary directory; never a relative path."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(home):
        home = tempfile.gettempdir()
    return os.path.join(home, "gradwire")


def _paths():
    """(module name, this build's cache directory, the module's file there), keyed by what
    the build depends on."""
    import torch

    digest = hashlib.sha256()
    for path in (_SOURCE, _HEADER):
        with open(path, "rb") as f:
            digest.update(f.read())
    # Builds of one torch version differ (pip, conda, source: their git revision and C++
    # ABI); so do the flags this module builds with.
    digest.update(repr((torch.__version__, torch.version.git_version, torch._C._GLIBCXX_USE_CXX11_ABI, sys.version, _FLAGS)).encode())
    name = "gradwire_torch_group"
    cache = os.path.join(_cache_dir(), f"torch-{digest.hexdigest()[:16]}")
    return name, cache, os.path.join(cache, name + ".so")  # as cpp_extension names it


def _load(retry_failed=False):
    global _where
    if not _wanted():
        return None, None  # asked for: no warning
    wait_s = _wait_s()
    try:
        name, cache, target = _paths()
        failed = os.path.join(cache, "failed")
        if not os.path.exists(target):
            os.makedirs(cache, exist_ok=True)
            with _build_lock(os.path.join(cache, "build.lock"), wait_s):
                if os.path.exists(target):
                    pass  # built while this process waited
                elif not retry_failed and os.path.exists(failed) and time.time() - os.path.getmtime(failed) < _RETRY_S:
                    with open(failed) as f:  # ranks starting together fail once, not in turn
                        why = f.read().strip()
                    return None, f"{why} (a build failed here {time.time() - os.path.getmtime(failed):.0f} s ago, {failed}; tried again after {_RETRY_S} s or by python -m gradwire._torch_native)"
                else:
                    try:
                        fast = _build(name, cache, target).FastGroup
                    except Exception as e:
                        with open(failed, "w") as f:
                            f.write(f"{type(e).__name__}: {_gist(e)}")
                        raise
                    _where = target
                    return fast, None
        spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _where = target
        return module.FastGroup, None
    except Exception as e:  # noqa: BLE001 (any failure leaves the Python group, said once)
        return None, f"{type(e).__name__}: {_gist(e)}"


def _gist(error):
    """One line of a failure: a compiler's first error where there is one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [repr(error)])[0 if errors else -1]


@contextlib.contextmanager
def _build_lock(path, wait_s):
    """Holds an exclusive flock on `path` while the body runs; waits for it at most
    `wait_s` seconds, then runs the body without it."""
    with open(path, "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break  # a stuck builder: build without it
                time.sleep(0.2)
        yield  # the lock goes with the file


def _build(name, cache, target):
    """Compiles the extension, loads it (a module loads once per process) and puts it in
    the cache."""
    from torch.utils import cpp_extension

    # cpp_extension runs `ninja` from PATH: the ninja package's (the extra's, wherever pip put
    # it: a virtual environment that is not activated, ~/.local) and the one beside this
    # interpreter come first.
    path = os.environ.get("PATH")
    first = [os.path.dirname(sys.executable)]
    try:
        import ninja

        first.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join([*first, os.defpath if path is None else path])
    try:
        with tempfile.TemporaryDirectory(dir=cache, prefix="build-") as tmp:
            module = cpp_extension.load(name, [_SOURCE], extra_include_paths=[_HERE], build_directory=tmp, verbose=False, is_python_module=True, **_FLAGS)
            os.replace(os.path.join(tmp, os.path.basename(target)), target)  # atomic: a process that finds it finds it whole
    finally:
        if path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = path
    return module



def main():
    """`python -m gradwire._torch_native`: builds the C++ part now (a container image's build
    step, say, rather than a job's first group) and says where it is, or why not."""
    fast, why = fast_group(retry_failed=True)
    if fast is None:
        print(f"gradwire: the torch backend's C++ hot path is not available: {why or 'GRADWIRE_TORCH_NATIVE=0'}")
        return 1
    print(f"gradwire: the torch backend's C++ hot path is built: {_where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
