"""Start N processes of a command on this machine, joined as one jax.distributed run.

    python scripts/launch_local.py -n 2 -- python sebulba/ppo_envpool.py --distributed \
        --actor-device-ids 0 --learner-device-ids 1 --run-name two_procs

Each process gets the coordinator in its environment: JAX_COORDINATOR_ADDRESS
(127.0.0.1:<free port>), JAX_NUM_PROCESSES and JAX_PROCESS_ID, which
`sebulba/*.py --distributed` read when their --coordinator-address / --num-processes /
--process-id flags are not given. Output lines are prefixed with `[i]`. SIGINT / SIGTERM /
SIGUSR1 are forwarded to every process. When one process exits non-zero, the others get
--grace-s seconds to end on their own and are then killed, so the launcher never waits
forever. Exit code: that of the process that failed first in time (128 + N for one
killed by signal N), named in one line on stderr (`launch_local: process 1 failed first
(exit 137, killed by SIGKILL)`), else 0; the others' later failures usually follow from it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_name(signum: int) -> str:
    """SIGKILL for 9; `signal 40` for a number without a name (real-time signals)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def launch(command: list[str], num_processes: int, grace_s: float) -> int:
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(num_processes):
        env = {**os.environ, "JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(num_processes),
               "JAX_PROCESS_ID": str(i), "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))  # signals reach them once: forwarded below

    def relay(i: int, proc: subprocess.Popen):
        for line in proc.stdout:
            sys.stdout.write(f"[{i}] {line}")
            sys.stdout.flush()

    relays = [threading.Thread(target=relay, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in relays:
        t.start()

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, forward)
    # One waiter per process, so failures are known in the order they happened (a polling loop
    # would order two failures within one poll by process index).
    lock, failures = threading.Lock(), []  # process indices, first failure first

    def wait(i: int, proc: subprocess.Popen):
        if proc.wait() != 0:
            with lock:
                failures.append(i)

    waiters = [threading.Thread(target=wait, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in waiters:
        t.start()
    failed_at = None
    while any(t.is_alive() for t in waiters):
        if failed_at is None and failures:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for i, p in enumerate(procs):
                if p.returncode is None:
                    print(f"launch_local: process {i} still running {grace_s:g}s after another failed; killing it",
                          file=sys.stderr, flush=True)
                    p.kill()
            failed_at = float("inf")  # killed once; the waiters see them end
        time.sleep(0.1)
    for t in relays:
        t.join(timeout=5)
    if not failures:
        return 0
    first = procs[failures[0]].returncode
    code = 128 - first if first < 0 else first  # killed by signal N: 128 + N, as a shell reports it
    how = f", killed by {signal_name(-first)}" if first < 0 else ""
    print(f"launch_local: process {failures[0]} failed first (exit {code}{how})", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [-n N] [--grace-s S] -- command [args ...]")
    parser.add_argument("-n", "--num-processes", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--grace-s", type=float, default=60.0,
                        help="seconds the others may keep running after one process failed (default 60)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.num_processes < 1:
        parser.error(f"-n {args.num_processes}: need at least 1 process")
    return launch(command, args.num_processes, args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
