"""The run directory runs/<run name>/: which process owns it (a lock, so two launches of one
run never write into it together) and what its config.json records beside the flags (the
script's own flags, the software, the script's importable name)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

from sebulba.config import ConfigError, RunFlags, script_flags


def script_args(flags: RunFlags) -> dict:
    """The values of the script's own flags (`config.script_flags`: none it hides), as config.json and W&B show them."""
    values = dataclasses.asdict(flags)
    return {name: values[name] for name in script_flags(type(flags))}


_owned: list[tuple[int, Path]] = []  # (descriptor, lock file) of the run directories this process owns


def run_dir_owner(run_dir: Path) -> str | None:
    """Take runs/<run name>.lock (an exclusive `flock`), so that one process at a time runs in
    `run_dir`: None when this process now owns it, else who does ("process 123 on host n1
    since ..."). The kernel drops the lock when the owner ends, killed (SIGKILL) or not, so a
    crashed run resumes unrefused; `release_run_dirs` removes the file when the run ends.

    Raises:
      ConfigError: the lock file's filesystem does not lock (flock fails other than "held")."""
    lock = run_dir.with_name(run_dir.name + ".lock")
    if any(owned == lock for _, owned in _owned):  # this process's already (a script's main called again)
        return None
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            return holder
        except OSError as error:  # ENOSYS: Lustre mounted without flock; ENOLCK: NFS without its lock service
            os.close(fd)
            with contextlib.suppress(OSError):  # a file no process can lock guards nothing
                lock.unlink()
            raise ConfigError(f"{lock.parent}/ is on a filesystem that cannot be locked ({error.strerror}), so two "
                              f"launches of one run could write {run_dir.name}/ together: launch from a directory on a "
                              "filesystem with locks (local disk; Lustre mounted with -o flock; NFS with its lock "
                              "service)") from error
        if lock.exists() and os.fstat(fd).st_ino == os.stat(lock).st_ino:  # not a file its last owner removed
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
              .encode(), 0)
    _owned.append((fd, lock))
    return None


def release_run_dirs():
    """Remove and unlock the run directories' lock files this process owns (`run_dir_owner`)."""
    while _owned:
        fd, lock = _owned.pop()
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)


def software() -> dict:
    """What a rerun needs to reproduce this one: Python's and the libraries' versions, the git
    commit of the code (with `dirty` when it had uncommitted changes; None outside a checkout)."""
    versions = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "envpool", "numpy", "tyro", "wandb",
                    "tensorboardX"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    here = Path(__file__).resolve().parent
    commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    git = None
    if commit.returncode == 0:
        git = {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    return {"versions": versions, "git": git}


def script_module(flags: RunFlags) -> str:
    """The importable name of the script whose `Args` `flags` is, e.g. "sebulba.ppo_envpool":
    what scripts/evaluate.py imports to rebuild the run's network. A script run as a file
    (`python sebulba/ppo_envpool.py`) defines its `Args` in `__main__`; its file's stem names
    it then ("sebulba.<stem>")."""
    name = type(flags).__module__
    path = getattr(sys.modules.get(name), "__file__", None)
    return f"sebulba.{Path(path).stem}" if name == "__main__" and path else name
