"""The metric sinks: TensorBoard event files in the run directory, mirrored to Weights & Biases
with --track. Every metric a script logs is listed, with its unit, in docs/ppo_envpool.md and
docs/impala_envpool.md; the learner's `Bookkeeping` (sebulba/learner.py) computes them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

# tensorboardX's writer imports torch where it is installed, only to accept torch tensors as
# values (`try: import torch`): 2-3 s at every launch on a box with torch (measured on
# tensorboardX 2.6). The scripts log floats, so that import is refused while tensorboardX loads;
# torch itself stays importable afterwards, and a process that already has it keeps it.
_blocked = "torch" not in sys.modules
if _blocked:
    sys.modules["torch"] = None  # `import torch` raises ImportError
try:
    from tensorboardX import SummaryWriter
    from tensorboardX.proto import event_pb2
finally:
    if _blocked:
        del sys.modules["torch"]


class Logger:
    """Console-free metric sink: TensorBoard events in `run_dir`, mirrored to W&B when `track`
    (the same W&B run id is reused on resume, so the curves continue). Called from the learner
    thread; a no-op where `enabled` is False (every process but process 0)."""

    def __init__(self, run_dir: Path, enabled: bool = True, track: bool = False, project: str = "sebulba",
                 entity: str | None = None, run_name: str | None = None, wandb_id: str | None = None,
                 config: dict | None = None, resumed_at: int | None = None):
        """`resumed_at`: the global step of the checkpoint a resumed run starts from. What an earlier
        session logged after it (it died before its next checkpoint) is superseded by what this
        session logs again (wandb#5632, tango#152): TensorBoard is told so by a session-start
        event at the step after it, which makes its readers drop the orphaned points; W&B gets
        the global step as a metric of its own instead of its `step`, which must only increase
        and would silently drop every point up to the old session's last one."""
        self.writer = self.wandb = None
        if not enabled:
            return
        # tensorboardX names the file events.out.tfevents.<unix seconds>.<host>: a resume within the same
        # second would open the same file and truncate the first session's events (tensorboardX#776).
        # The nanosecond suffix keeps the names distinct and in session order (readers go by name).
        self.writer = SummaryWriter(str(run_dir), filename_suffix=f".{time.time_ns()}")
        if resumed_at is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self.writer._get_file_writer().add_event(event_pb2.Event(step=resumed_at + 1, wall_time=time.time(),
                                                                     session_log=start))
        if track:
            import wandb  # only with --track: its import is half a second of every launch

            self.wandb = wandb.init(project=project, entity=entity, name=run_name, id=wandb_id, resume="allow",
                                    dir=str(run_dir), config=config)
            self.wandb.define_metric("global_step")
            self.wandb.define_metric("*", step_metric="global_step")

    def log(self, metrics: dict[str, float], step: int):
        if self.writer is None:
            return
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics | {"global_step": step})

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
