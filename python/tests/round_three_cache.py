"""The torch backend's C++ build cache cannot be made to load another user's code (issue 59,
item 2). Run as root by tests/round_three_py.rs; with no argument it sets up every case in
a scratch directory and runs `round_three_cache.py group` once per case, a 1-rank world
that registers the backend and creates a group, then reports whether it loaded and why not.

A shared library whose constructor writes a marker file stands for the planted code; it is
planted where a process might look for the build:

    fallback   XDG_CACHE_HOME relative: the predictable temporary-directory path
               ($TMPDIR/gradwire/torch-KEY), made by `nobody`; the home's cache holds a
               .so owned by `nobody` in directories the user owns
    no-home    XDG_CACHE_HOME relative, HOME unset and no passwd entry for the uid: the
               same, and $TMPDIR/gradwire-UID made by `nobody` too
    open       XDG_CACHE_HOME's gradwire folder writable by everyone, a .so of `nobody`s in it
    swapped    a real build, then its .so replaced by the user with another file

Each case passes when the marker never appears and init_process_group's error says why
the cache was not used ("cache: ok CASE"); "cache: FAIL CASE ..." otherwise. Exits 1 if any case failed.
"""

import hashlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile

NOBODY = pwd.getpwnam("nobody")
SO = "gradwire_torch_backend.so"


def group():
    """One rank: register the backend, make a group, allreduce; print what happened."""
    if os.environ.get("R3_NO_PASSWD") == "1":
        # Stands for a uid without a passwd entry (a container's --user 12345): the lookup
        # expanduser makes fails as it would there.
        def no_entry(uid):
            raise KeyError(f"getpwuid(): uid not found: {uid}")

        pwd.getpwuid = no_entry
    import torch
    import torch.distributed as dist

    import gradwire.torch  # noqa: F401  (registers the backend)

    try:
        dist.init_process_group("gradwire")
    except RuntimeError as e:  # the backend refused to load or build: the error says why
        print("RESULT " + json.dumps({"native": False, "warnings": [str(e)]}), flush=True)
        return
    x = torch.ones(4)
    dist.all_reduce(x)
    assert torch.equal(x, torch.ones(4)), x
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"native": True, "warnings": []}), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(env):
    full = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME", "TMPDIR")}
    full.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "GRADWIRE_JOB_SECRET": "round-three-cache"})
    full.update({k: v for k, v in env.items() if v is not None})
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "group"], env=full, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the group process failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


def own(path, owner, mode):
    os.chown(path, owner.pw_uid, owner.pw_gid)
    os.chmod(path, mode)


def plant(so, folder, owner, dir_owner=None, dir_mode=0o777):
    """Makes `folder` (and its parents from the first missing one) owned by `dir_owner`
    (default: `owner`), then puts the planted library there under the build's name with a
    record of its SHA-256 beside it, both owned by `owner`."""
    missing = []
    path = folder
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        os.mkdir(path)
        own(path, dir_owner or owner, dir_mode)
    target = os.path.join(folder, SO)
    shutil.copyfile(so, target)
    own(target, owner, 0o755)
    with open(so, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(target + ".sha256", "w") as f:
        f.write(digest + "\n")
    own(target + ".sha256", owner, 0o644)


def main():
    root = tempfile.mkdtemp(prefix="gradwire-r3-cache-")
    os.chmod(root, 0o755)
    failures = []
    try:
        markers = os.path.join(root, "markers")
        os.mkdir(markers)
        os.chmod(markers, 0o777)
        marker = os.path.join(markers, "planted-code-ran")
        # The planted code: a constructor that leaves the marker when the library is loaded.
        src = os.path.join(root, "planted.c")
        with open(src, "w") as f:
            f.write('#include <fcntl.h>\n#include <unistd.h>\n__attribute__((constructor)) static void planted(void) {\n'
                    f'  int fd = open("{marker}", O_CREAT | O_WRONLY | O_APPEND, 0666);\n  if (fd >= 0) {{ write(fd, "ran\\n", 4); close(fd); }}\n}}\n')
        so = os.path.join(root, "planted.so")
        subprocess.run(["cc", "-shared", "-fPIC", "-o", so, src], check=True)
        tmp = os.path.join(root, "tmp")  # stands for /tmp: everyone's, sticky
        os.mkdir(tmp)
        os.chmod(tmp, 0o1777)
        home = os.path.join(root, "home")
        os.mkdir(home, 0o700)
        os.environ["XDG_CACHE_HOME"] = os.path.join(root, "unused")
        from gradwire import _torch_native

        key = os.path.basename(_torch_native._paths()[1])  # torch-<hash of torch, source, flags>
        del os.environ["XDG_CACHE_HOME"]
        me = pwd.getpwuid(os.getuid())
        # What `nobody` can plant: the predictable temporary paths (the old fallback and a
        # per-uid one), with directories of its own.
        plant(so, os.path.join(tmp, "gradwire", key), NOBODY)
        plant(so, os.path.join(tmp, f"gradwire-{os.getuid()}", key), NOBODY)
        # A library of `nobody`s in the user's own (0700) cache directories.
        plant(so, os.path.join(home, ".cache", "gradwire", key), NOBODY, dir_owner=me, dir_mode=0o700)
        # The user's cache folder left writable by everyone.
        plant(so, os.path.join(root, "open", "gradwire", key), NOBODY, dir_owner=me, dir_mode=0o777)
        os.chmod(os.path.join(root, "open"), 0o755)
        no_compiler = {"CXX": "/bin/false", "TMPDIR": tmp}
        cases = [
            ("fallback", {**no_compiler, "XDG_CACHE_HOME": "relative/cache", "HOME": home}, "owned by uid 65534"),
            ("no-home", {**no_compiler, "XDG_CACHE_HOME": "relative/cache", "R3_NO_PASSWD": "1"}, "owned by uid 65534"),
            ("open", {**no_compiler, "XDG_CACHE_HOME": os.path.join(root, "open"), "HOME": home}, "writable by others"),
        ]
        for name, env, why in cases:
            seen = run_group(env)
            ran = os.path.exists(marker)
            if ran or not any(why in w for w in seen["warnings"]):
                failures.append(f"{name}: planted code ran: {ran}; warnings: {seen['warnings']}")
            else:
                print(f"cache: ok {name} ({seen['warnings'][0]})", flush=True)
            if ran:
                os.unlink(marker)
        # A real build (the user's, in their own cache: built once per run, copied here
        # with its record), then its library replaced by the user's own different file.
        xdg = os.path.join(root, "xdg")
        env = {"XDG_CACHE_HOME": xdg, "HOME": home, "TMPDIR": tmp}
        built = subprocess.run([sys.executable, "-m", "gradwire._torch_native"], capture_output=True, text=True, timeout=600)
        users = built.stdout.strip().rsplit(": ", 1)[-1]
        if built.returncode != 0 or not os.path.isfile(users):
            failures.append(f"swapped: the build failed:\n{built.stdout}\n{built.stderr}")
        else:
            where = os.path.join(xdg, "gradwire", key, os.path.basename(users))
            os.makedirs(os.path.dirname(where), mode=0o700)
            for suffix, mode in (("", 0o700), (".sha256", 0o600)):
                shutil.copyfile(users + suffix, where + suffix)
                os.chmod(where + suffix, mode)
            first = run_group(env)
            shutil.copyfile(so, where)  # the user's own file now, mode unchanged
            seen = run_group(env)
            ran = os.path.exists(marker)
            if not first["native"] or ran or not any("SHA-256" in w for w in seen["warnings"]):
                failures.append(f"swapped: the real build loaded: {first['native']} {first['warnings']}; after the swap the planted code ran: {ran}; warnings: {seen['warnings']}")
            else:
                print(f"cache: ok swapped ({seen['warnings'][0]})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for f in failures:
        print(f"cache: FAIL {f}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["group"]:
        group()
    else:
        sys.exit(main())
