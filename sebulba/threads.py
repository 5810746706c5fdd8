"""Thread plumbing: the stop exceptions, the versioned parameter slot actors read, queue
operations that time out, per-stage timers, and the supervisor that runs every thread of a run
and turns the first failure or stop signal into a clean end.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import jax


class Stopped(Exception):
    """Raised inside a thread when the run is stopping; not an error."""


class StallError(RuntimeError):
    """No progress for --stall-timeout-s; the message names the waiting component."""


class RunFailed(RuntimeError):
    """A thread failed or stalled; its traceback was printed when it happened."""


class ParamsSlot:
    """Parameter versions published by the learner, {actor device: params} each; the newest
    `keep` are held (more than one only for --deterministic, whose actors ask for an exact one)."""

    def __init__(self, keep: int = 1):
        self._cond = threading.Condition()
        self.keep = keep
        self.version = -1
        self.history: dict[int, dict[jax.Device, Any]] = {}

    def publish(self, version: int, params: dict[jax.Device, Any]):
        with self._cond:
            self.version, self.history[version] = version, params
            for old in [v for v in self.history if v <= version - self.keep]:
                del self.history[old]
            self._cond.notify_all()

    def wait(self, min_version: int, stop: threading.Event, timeout_s: float, who: str, exact: bool = False):
        """(version, {device: params}) once version >= min_version: the newest, or version
        `min_version` itself when `exact`. Never blocks when the version is already there."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.version < min_version:
                if stop.is_set():
                    raise Stopped
                if time.monotonic() > deadline:
                    raise StallError(f"{who} waited {timeout_s:.0f}s for params version {min_version} "
                                     f"(learner is at {self.version}): the learner stalled, or one update takes "
                                     "longer than that here (then raise --stall-timeout-s)")
                self._cond.wait(0.1)
            version = min_version if exact else self.version
            return version, self.history[version]


def timed_put(q: queue.Queue, item, stop: threading.Event, timeout_s: float, who: str):
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        try:
            return q.put(item, timeout=0.1)
        except queue.Full:
            if time.monotonic() > deadline:
                raise StallError(f"{who} could not hand a rollout to the learner for {timeout_s:.0f}s: "
                                 "the learner stopped consuming, or one update takes longer than that here "
                                 "(then raise --stall-timeout-s)") from None
    raise Stopped


def timed_get(q: queue.Queue, stop: threading.Event, timeout_s: float, who: str):
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise StallError(f"{who} received no rollout for {timeout_s:.0f}s: the actor stalled, or one "
                                 "rollout takes longer than that here (then raise --stall-timeout-s)") from None
    raise Stopped


class Timer:
    """Accumulates seconds per stage name: `with timer("env_recv"): ...`."""

    def __init__(self):
        self.totals: dict[str, float] = collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.totals[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), collections.defaultdict(float)
        return totals


class AnyEvent:
    """is_set() when any of the events is set."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """SIGINT / SIGTERM / SIGUSR1 handlers for the run: the first signal calls `on_stop(signum)`
    (the learner then checkpoints and the run ends); a second SIGINT exits at once with 130.
    A no-op outside the main thread (signals reach only the main thread). Use as a context
    manager: the previous handlers come back on exit."""

    def __init__(self, on_stop, doing: str):
        self.on_stop, self.doing = on_stop, doing  # doing: what the console says the run does now
        self.received: list[tuple[int, float]] = []  # (signal, time)
        self.previous = {}

    def handle(self, signum, _frame):
        # A second SIGINT exits at once; one within a second of the first is the same Ctrl-C
        # delivered twice (to the process and to its group, as `timeout -s INT` does).
        if self.received and signum == signal.SIGINT and time.monotonic() - self.received[0][1] > 1.0:
            print("second Ctrl-C: exiting now without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        if self.received:
            return
        self.received.append((signum, time.monotonic()))
        hint = " (Ctrl-C again exits at once)" if signum == signal.SIGINT else ""
        print(f"{signal.Signals(signum).name}: {self.doing}{hint}", flush=True)
        self.on_stop(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Supervisor:
    """Runs a run's named daemon threads. A thread's exception (other than `Stopped`) is
    recorded, its traceback printed once, and `stop` set so that every other thread returns."""

    join_timeout_s = 10.0  # threads poll the stop event every 0.1 s; one stuck in native code is left

    def __init__(self, stop: threading.Event):
        self.stop = stop
        self.errors: list[tuple[str, BaseException]] = []
        self.threads: list[threading.Thread] = []

    def add(self, name: str, fn, *fn_args, first: bool = False) -> threading.Thread:
        """A thread running fn(*fn_args), started by `run` (`first`: before the others)."""
        def body():
            try:
                fn(*fn_args)
            except Stopped:
                pass
            except BaseException as e:  # noqa: BLE001 - every failure ends the run
                self.errors.append((name, e))
                traceback.print_exc()
                self.stop.set()
        thread = threading.Thread(target=body, name=name, daemon=True)
        self.threads.insert(0 if first else len(self.threads), thread)
        return thread

    def run(self, main: threading.Thread):
        """Start every thread, wait until `main` returns or the run stops, then set `stop` and
        join them all (at most join_timeout_s in all)."""
        try:
            for t in self.threads:
                t.start()
            while main.is_alive() and not self.stop.is_set():
                main.join(0.2)
        finally:
            self.stop.set()
            deadline = time.monotonic() + self.join_timeout_s
            for t in self.threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def raise_first_error(self, context: str = ""):
        """Raises RunFailed for the first thread that failed (none: returns)."""
        if self.errors:
            name, error = self.errors[0]
            raise RunFailed(f"{name} failed: {error!r}{context}") from error
