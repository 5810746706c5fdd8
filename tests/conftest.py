"""Test setup: four virtual CPU devices (set before any JAX backend starts), runs in a temp dir,
and one compilation cache for the session's runs and child processes (not the user's)."""

import os
import tempfile

import jax
import pytest

os.environ["SEBULBA_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="sebulba-test-xla-cache-")  # read by RunFlags

jax.config.update("jax_num_cpu_devices", 4)
assert len(jax.devices()) == 4  # start the backend now: later requests cannot add devices


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Every test writes runs/ and wandb/ under its own temporary directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
