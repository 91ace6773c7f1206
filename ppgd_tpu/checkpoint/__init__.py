"""Checkpoint storage [C1]-[C4]: flat `{leaf path: array}` state <-> RUN_DIR/ckpts/<step>/."""

from ppgd_tpu.checkpoint.audit import digest, ls, verify
from ppgd_tpu.checkpoint.checkpointer import (Checkpointer, Restored, committed_manifest,
                                              damaged, restore, save)
from ppgd_tpu.checkpoint.manifest import (PARTS, DamagedCheckpoint, NewerCheckpoint,
                                          committed_steps, latest_step, list_steps, retain)

__all__ = [
    "Checkpointer", "DamagedCheckpoint", "NewerCheckpoint", "PARTS", "Restored",
    "committed_manifest", "committed_steps", "damaged", "digest", "latest_step", "list_steps",
    "ls", "restore",
    "retain", "save", "verify",
]
