"""Test setup: four virtual CPU devices (set before any JAX backend starts), runs in a temp dir,
and one persistent compilation cache for the whole session (not the user's): the tests' own
programs, their runs and child processes, shared by the pytest-xdist workers (the controller
makes it; the workers inherit its environment). Tests build the same small programs again and
again (a fresh `make_update_fn` per test); from the second time on XLA's compile is a read."""

import os
import tempfile

import jax
import pytest

from sebulba.devices import use_compilation_cache

if "SEBULBA_TEST_XLA_CACHE" not in os.environ:
    os.environ["SEBULBA_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="sebulba-test-xla-cache-")
os.environ["SEBULBA_COMPILATION_CACHE_DIR"] = os.environ["SEBULBA_TEST_XLA_CACHE"]  # read by RunFlags
use_compilation_cache(os.environ["SEBULBA_TEST_XLA_CACHE"])

jax.config.update("jax_num_cpu_devices", 4)
assert len(jax.devices()) == 4  # start the backend now: later requests cannot add devices


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Every test writes runs/ and wandb/ under its own temporary directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
