"""Test setup: four virtual CPU devices (set before any JAX backend starts), runs in a temp dir,
and one persistent compilation cache for the whole session (not the user's): the tests' own
programs, their runs and child processes, shared by the pytest-xdist workers (the controller
makes it; the workers inherit its environment). Tests build the same small programs again and
again (a fresh `make_update_fn` per test); from the second time on XLA's compile is a read.

The suite compiles hundreds of small programs once each and runs most of them a few times, so
its XLA:CPU backend generates code without LLVM's optimisations (XLA_FLAGS
--xla_backend_optimization_level=0, inherited by every child process): the programs (HLO) are
the same and compiling them takes about a quarter less CPU time (measured on tests/test_docs.py
and tests/test_impala.py: 239 -> 184 CPU-seconds). Float results may differ in the last bits,
as they may on another CPU: the learning tests' figures were measured at this level, and their
thresholds leave room for other numerics. No test times anything. An XLA_FLAGS that sets the
level itself is kept."""

import gc
import os
import signal
import tempfile
import threading

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads it when it starts)
import pytest  # noqa: E402

from sebulba.devices import use_compilation_cache  # noqa: E402

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


def pytest_sessionfinish(session, exitstatus):
    """A pytest-xdist worker whose tests have all run ignores SIGINT. The controller ends a worker
    by closing its gateway, and execnet sends the worker a SIGINT when its main task has not
    returned 5 s later (execnet's WorkerGateway._terminate_execution); a worker still
    garbage-collecting the hundreds of programs it compiled took that long, the SIGINT landed
    inside jax's gc callback (`_xla_gc_callback`), and a passing suite ended with a
    PytestUnraisableExceptionWarning whose traceback ended in KeyboardInterrupt. Nothing is left
    to interrupt then: the worker finishes on its own. JAX's caches are freed first, so there is
    less to collect."""
    jax.clear_caches()
    gc.collect()
    if hasattr(session.config, "workerinput") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
