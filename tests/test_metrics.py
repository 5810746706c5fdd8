"""The metric sinks (sebulba/metrics.py) read back with TensorBoard's own reader."""

import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sebulba.metrics import Logger


def test_two_sessions_within_a_second_keep_both_sessions_scalars(tmp_path):
    """A run stopped and resumed within one second writes two event files into one run
    directory; tensorboardX names them by the second (tensorboardX#776): both must survive."""
    for steps in ((100, 200), (300, 400)):  # the first session, then the resumed one
        logger = Logger(tmp_path)
        for step in steps:
            logger.log({"charts/sps": float(step)}, step)
        logger.close()
    events = EventAccumulator(str(tmp_path)).Reload()
    assert [(e.step, e.value) for e in events.Scalars("charts/sps")] == [(s, float(s)) for s in (100, 200, 300, 400)]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2


def test_a_disabled_logger_writes_nothing(tmp_path):
    logger = Logger(tmp_path, enabled=False)  # every process but process 0
    logger.log({"charts/sps": 1.0}, 1)
    logger.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a subprocess
def test_loading_the_sinks_does_not_import_torch_where_it_is_installed(tmp_path):
    """tensorboardX imports torch if it can (2-3 s at every launch); metrics.py refuses it that
    import, and torch stays importable afterwards. A stand-in `torch` package records being imported."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("import sys\nsys.stderr.write('torch imported\\n')\nclass Tensor: pass\n")
    code = "import sys\nimport sebulba.metrics\nprint('torch' in sys.modules)\nimport torch\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"] and out.stderr.count("torch imported") == 1, out.stdout + out.stderr
