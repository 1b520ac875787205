"""The "gradwire" torch backend (_torch_backend.cpp), built against the torch in use.

torch's C++ ABI changes between releases, so no wheel can carry this extension: it is
compiled at the first gradwire group a process makes (torch.utils.cpp_extension: g++ and
ninja, about a minute of one core) and cached under ~/.cache/gradwire ($XDG_CACHE_HOME/gradwire
where XDG_CACHE_HOME is absolute; $TMPDIR/gradwire-UID for a user without a home) by torch
build, Python, build flags and source hash; later processes load it in milliseconds.
`python -m gradwire._torch_native` builds it ahead (a container image's build step).

Loading a cached library runs its code in this process, so the cache is trusted only as far
as it is the user's own: every folder on its path belongs to the user or root and no one
else can write it (a sticky one such as /tmp aside), the folders gradwire makes are 0700,
and a library loads only if the user owns it, no one else can write it and its SHA-256 is
the one recorded beside it when it was built. Anything else is refused, and the error says
why. Ranks starting together build it once: the others wait on a file lock (flock, which
the kernel releases when its holder dies, so a killed build leaves no stale lock), for at
most GRADWIRE_TORCH_NATIVE_WAIT_S (default 600) seconds before building on their own, and a
build that failed is not tried again for 10 minutes.

Where it cannot be built (no compiler, no ninja, an unsafe cache) making a gradwire group
fails with an error that says why.
"""

import contextlib
import fcntl
import hashlib
import importlib.util
import math
import os
import stat
import sys
import tempfile
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "_torch_backend.cpp")
_HEADER = os.path.join(_HERE, "gradwire.h")

# How it is compiled (part of the cache key).
_FLAGS = {"extra_cflags": ["-O2"]}

# A failed build is not tried again for this long (the ranks starting with it share it).
_RETRY_S = 600

_lock = threading.Lock()
_loaded = None  # (the extension module or None, why not)
_where = None  # the file it was loaded from


def backend_module(retry_failed=False):
    """The built extension (its GradwireBackend class and helpers), built once per process;
    RuntimeError saying why where it cannot be built or loaded. `retry_failed`: build even
    if a build failed here within the last 10 minutes."""
    global _loaded
    with _lock:
        if _loaded is None or (retry_failed and _loaded[0] is None):
            _loaded = _load(retry_failed)
            if _loaded[0] is not None:
                from . import load_library

                _loaded[0].load_library(load_library()._name)
    module, why = _loaded
    if module is None:
        raise RuntimeError(f"gradwire: the torch backend cannot be built or loaded: {why}")
    return module


def _wait_s():
    value = os.environ.get("GRADWIRE_TORCH_NATIVE_WAIT_S", "600").strip()
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= 86400:
        raise ValueError(f"GRADWIRE_TORCH_NATIVE_WAIT_S={value!r}: expected seconds to wait for another process's build, 0 to 86400")
    return seconds


class UnsafeCache(Exception):
    """The build cache is not the user's own: another user could put code in it."""


def _cache_dir():
    """(the user's cache folder, gradwire's folder in it): $XDG_CACHE_HOME and gradwire,
    else ~/.cache and gradwire, else (no home: a container's uid without a passwd entry)
    $TMPDIR and gradwire-UID. A relative XDG_CACHE_HOME is ignored, as the XDG spec says.
    Not checked here: _private_dir does."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return xdg, "gradwire"
    home = os.path.expanduser("~")
    if os.path.isabs(home):
        return os.path.join(home, ".cache"), "gradwire"
    # Predictable, so another user may have made it first: _private_dir refuses it then.
    return tempfile.gettempdir(), f"gradwire-{os.geteuid()}"


def _private_dir(base, path):
    """Makes `path` (under the user's folder `base`) a directory only this user can write,
    or raises UnsafeCache. Every directory from / down to `base` (symlinks resolved) must
    belong to the user or root and be writable by no one else, or be sticky as /tmp is
    (others cannot rename or remove what is not theirs there). Below `base` (gradwire's own
    folders) each must be a real directory of the user's; those it makes are 0700."""
    uid = os.geteuid()

    def check(here, own):
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            try:
                os.mkdir(here, 0o700)
            except FileExistsError:
                pass  # another rank made it
            st = os.lstat(here)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeCache(f"{here} is not a directory")
        if st.st_uid != uid and (own or st.st_uid != 0):
            raise UnsafeCache(f"{here} is owned by uid {st.st_uid}, not by this user (uid {uid})")
        if st.st_mode & 0o022 and (own or not st.st_mode & stat.S_ISVTX):
            raise UnsafeCache(f"{here} is writable by others than its owner (mode {stat.S_IMODE(st.st_mode):04o})")

    real = os.path.realpath(base)
    parts = real.split(os.sep)
    for i in range(1, len(parts) + 1):
        check(os.sep.join(parts[:i]) or os.sep, own=False)
    for part in os.path.relpath(path, base).split(os.sep):
        real = os.path.join(real, part)
        check(real, own=True)
    return real


def _own_file(path):
    """Raises UnsafeCache unless `path` is a regular file (not a link) of this user's that
    no one else can write."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCache(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise UnsafeCache(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise UnsafeCache(f"{path} is writable by others than its owner (mode {stat.S_IMODE(st.st_mode):04o})")


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(target):
    """Raises UnsafeCache unless the library `target` is the user's own build: owned by the
    user, writable by no one else, with the SHA-256 recorded beside it at build time."""
    record = target + ".sha256"
    _own_file(record)
    _own_file(target)
    with open(record) as f:
        recorded = f.read().strip()
    if _sha256(target) != recorded:
        raise UnsafeCache(f"{target} does not match the SHA-256 recorded when it was built ({record}); it was changed since")


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
    name = "gradwire_torch_backend"
    cache = os.path.join(*_cache_dir(), f"torch-{digest.hexdigest()[:16]}")
    return name, cache, os.path.join(cache, name + ".so")  # as cpp_extension names it


def _load(retry_failed=False):
    global _where
    wait_s = _wait_s()
    try:
        name, cache, target = _paths()
        cache = _private_dir(_cache_dir()[0], cache)
        target = os.path.join(cache, os.path.basename(target))
        failed = os.path.join(cache, "failed")
        # Without its record a library is not known to be this user's build (one from
        # before the records, or a build cut short): it is built again.
        if not os.path.exists(target + ".sha256"):
            with _build_lock(os.path.join(cache, "build.lock"), wait_s):
                if os.path.exists(target + ".sha256"):
                    pass  # built while this process waited
                elif not retry_failed and os.path.exists(failed) and time.time() - os.path.getmtime(failed) < _RETRY_S:
                    with open(failed) as f:  # ranks starting together fail once, not in turn
                        why = f.read().strip()
                    return None, f"{why} (a build failed here {time.time() - os.path.getmtime(failed):.0f} s ago, {failed}; tried again after {_RETRY_S} s or by python -m gradwire._torch_native)"
                else:
                    try:
                        fast = _build(name, cache, target)
                    except Exception as e:
                        with open(failed, "w") as f:
                            f.write(f"{type(e).__name__}: {_gist(e)}")
                        raise
                    _where = target
                    return fast, None
        _verified(target)
        spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _where = target
        return module, None
    except UnsafeCache as e:
        return None, f"the build cache is not safe to load from: {e}; nothing is built in or loaded from it (remove it, or set XDG_CACHE_HOME to a folder of your own)"
    except Exception as e:  # noqa: BLE001 (any failure is said, with its first line)
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
            built = os.path.join(tmp, os.path.basename(target))
            os.chmod(built, 0o700)  # whatever the umask: a library others can write is refused
            # The record goes first: a process that finds the library finds its record, and
            # loads the library only if it still hashes to it (_verified).
            record = os.path.join(tmp, "record")
            with open(os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(_sha256(built) + "\n")
            os.replace(record, target + ".sha256")
            os.replace(built, target)  # atomic: a process that finds it finds it whole
    finally:
        if path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = path
    return module



def main():
    """`python -m gradwire._torch_native`: builds the backend now (a container image's build
    step, say, rather than a job's first group) and says where it is, or why not."""
    try:
        backend_module(retry_failed=True)
    except RuntimeError as e:
        print(e)
        return 1
    print(f"gradwire: the torch backend is built: {_where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
