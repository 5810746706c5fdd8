"""The metric sinks: TensorBoard event files in the run directory, mirrored to Weights & Biases
with --track. Every metric a script logs is listed, with its unit, in docs/ppo_envpool.md and
docs/impala_envpool.md; the learner's `Bookkeeping` (sebulba/learner.py) computes them.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import wandb
from tensorboardX import SummaryWriter


class Logger:
    """Console-free metric sink: TensorBoard events in `run_dir`, mirrored to W&B when `track`
    (the same W&B run id is reused on resume, so the curves continue). Called from the learner
    thread; a no-op where `enabled` is False (every process but process 0)."""

    def __init__(self, run_dir: Path, enabled: bool = True, track: bool = False, project: str = "sebulba",
                 entity: str | None = None, run_name: str | None = None, wandb_id: str | None = None,
                 config: dict | None = None):
        self.writer = self.wandb = None
        if not enabled:
            return
        # tensorboardX names the file events.out.tfevents.<unix seconds>.<host>: a resume within the same
        # second would open the same file and truncate the first session's events (tensorboardX#776).
        self.writer = SummaryWriter(str(run_dir), filename_suffix=f".{uuid.uuid4().hex[:8]}")
        if track:
            self.wandb = wandb.init(project=project, entity=entity, name=run_name, id=wandb_id, resume="allow",
                                    dir=str(run_dir), config=config)

    def log(self, metrics: dict[str, float], step: int):
        if self.writer is None:
            return
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
