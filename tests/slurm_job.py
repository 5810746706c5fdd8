"""The trainer of tests/test_slurm.py's jobs: sebulba/ppo_envpool.py, run as the sbatch template's
SCRIPT, with one fault switched on by SEBULBA_TEST_FAULT (a hook for the tests; users run the
scripts themselves):

  unset         nothing: the script as users run it
  learner       process 1's learner raises at its 2nd update
  closed-port   process 0 runs its coordinator on another port than the one every process is
                given, so process 1 meets a closed port (as behind a firewall)
"""

import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sebulba.ppo_envpool as ppo  # noqa: E402
from sebulba.runtime import run_cli  # noqa: E402

fault, process = os.environ.get("SEBULBA_TEST_FAULT"), os.environ["SLURM_PROCID"]
if fault == "learner" and process == "1":
    real = ppo.make_update_fn

    def make_update_fn(*args, **kwargs):
        update, calls = real(*args, **kwargs), []

        def faulty(*update_args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError(f"injected learner fault in process 1 at {time.time()}")
            return update(*update_args)

        faulty.programs = update.programs  # (the memory check compiles them)
        return faulty

    ppo.make_update_fn = make_update_fn
elif fault == "closed-port" and process == "0":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["JAX_COORDINATOR_BIND_ADDRESS"] = f"[::]:{s.getsockname()[1]}"
elif fault is not None and fault not in ("learner", "closed-port"):
    raise SystemExit(f"unknown SEBULBA_TEST_FAULT={fault}")

sys.exit(run_cli(ppo.Args, ppo.main))
