"""The two scripts stand alone (copy, don't import), so every top-level block they both
define must stay identical, apart from the blocks that differ on purpose listed here."""

import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "sebulba"
# Algorithm-specific on purpose: hyperparameters, their checks, the loss and update, wiring.
DIFFERENT = {"Args", "Setup", "resolve", "make_train_state", "make_update_fn", "main"}


def blocks(path: Path) -> dict[str, str]:
    source = path.read_text()
    found = {}
    for node in ast.parse(source).body:
        names = [node.name] if hasattr(node, "name") else [t.id for t in getattr(node, "targets", [])
                                                             if isinstance(t, ast.Name)]
        for name in names:
            found[name] = ast.get_source_segment(source, node)
    return found


def test_shared_blocks_are_identical():
    ppo, impala = blocks(SCRIPTS / "ppo_envpool.py"), blocks(SCRIPTS / "impala_envpool.py")
    shared = (set(ppo) & set(impala)) - DIFFERENT
    assert len(shared) >= 30  # actors, assembly, placement, supervision, checkpoints, logging, CLI
    drifted = sorted(name for name in shared if ppo[name] != impala[name])
    assert drifted == [], f"edit both scripts the same way: {drifted}"
    assert DIFFERENT <= set(ppo) & set(impala)  # nothing on the list is stale
