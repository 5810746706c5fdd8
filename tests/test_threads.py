"""The shared thread plumbing (sebulba/threads.py) on its own: the supervisor ends every thread
on the first failure and reports it once; every wait times out into an error naming who waited;
a stop signal reaches the run once, and the handlers come back afterwards."""

import os
import queue
import signal
import threading
import time

import pytest

from sebulba.threads import (AnyEvent, ParamsSlot, RunFailed, StallError, StopSignals, Stopped, Supervisor, Timer,
                             timed_get, timed_put)


def waiter(stop: threading.Event, finished: list):
    while not stop.is_set():
        time.sleep(0.01)
    finished.append(threading.current_thread().name)
    raise Stopped  # a thread told to stop: not an error


def test_the_first_failure_stops_every_thread_and_is_raised_once(capsys):
    stop, finished = threading.Event(), []
    supervisor = Supervisor(stop)
    supervisor.add("waiter-0", waiter, stop, finished)
    supervisor.add("waiter-1", waiter, stop, finished)

    def fail():
        time.sleep(0.05)
        raise ValueError("injected")

    main = supervisor.add("learner", fail)
    start = time.monotonic()
    supervisor.run(main)
    assert time.monotonic() - start < 5 and sorted(finished) == ["waiter-0", "waiter-1"]
    assert not any(t.is_alive() for t in supervisor.threads)
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "ValueError: injected" in err
    with pytest.raises(RunFailed, match=r"learner failed: ValueError\('injected'\) \(context\)"):
        supervisor.raise_first_error(" (context)")


def test_a_clean_run_raises_nothing():
    stop = threading.Event()
    supervisor = Supervisor(stop)
    main = supervisor.add("learner", lambda: None)
    supervisor.run(main)
    assert stop.is_set() and supervisor.errors == []
    supervisor.raise_first_error()


def test_queue_operations_time_out_naming_the_stalled_side():
    stop, full, empty = threading.Event(), queue.Queue(maxsize=1), queue.Queue()
    full.put(0)
    with pytest.raises(StallError, match="actor 3 could not hand a rollout to the learner for 0s"):
        timed_put(full, 1, stop, 0.2, "actor 3")
    with pytest.raises(StallError, match="learner received no rollout for 0s: the actor stalled"):
        timed_get(empty, stop, 0.2, "learner")
    stop.set()
    with pytest.raises(Stopped):
        timed_get(empty, stop, 10, "learner")
    with pytest.raises(Stopped):
        timed_put(full, 1, stop, 10, "actor")


def test_params_slot_gives_the_newest_or_the_exact_version_and_times_out():
    slot, stop = ParamsSlot(keep=3), threading.Event()
    for version in range(5):
        slot.publish(version, {"device": version * 10})
    assert slot.wait(1, stop, 1, "actor") == (4, {"device": 40})  # newest
    assert slot.wait(3, stop, 1, "actor", exact=True) == (3, {"device": 30})  # --deterministic
    assert sorted(slot.history) == [2, 3, 4]  # the newest `keep`
    with pytest.raises(StallError, match="actor waited 0s for params version 7 \\(learner is at 4\\)"):
        slot.wait(7, stop, 0.2, "actor")
    assert AnyEvent(threading.Event(), stop).is_set() is False
    stop.set()
    with pytest.raises(Stopped):
        slot.wait(7, stop, 10, "actor")


def test_timer_sums_seconds_per_stage():
    timer = Timer()
    for _ in range(2):
        with timer("env_recv_time_s"):
            time.sleep(0.01)
    totals = timer.pop()
    assert list(totals) == ["env_recv_time_s"] and 0.02 <= totals["env_recv_time_s"] < 0.5
    assert timer.pop() == {}


def test_a_stop_signal_reaches_the_run_once_and_the_handlers_come_back(capsys):
    received = []
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(received.append, "checkpointing and stopping"):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second, different signal: already stopping
        time.sleep(0.1)
    assert received == [signal.SIGTERM]
    assert capsys.readouterr().out == "SIGTERM: checkpointing and stopping\n"
    assert signal.getsignal(signal.SIGTERM) is before
