"""Checkpoints that survive interruptions: verified atomic files, `last.ckpt` on its own schedule.

- `write_checkpoint` streams `torch.save` into a temporary file in the destination folder,
  fsyncs it, and renames it over the old file (then fsyncs the folder): a reader sees the
  previous complete file or the new complete file, never a partial one, whatever `$TMPDIR` is.
  A failed write (full disk, a kill) leaves the previous checkpoint and removes the temporary
  file (a kill leaves it for `remove_stale_temporaries`, called when a run starts).
- Each file carries the SHA-256 of its bytes in the zip archive comment (a `torch.save` file is a
  zip archive; the comment is its last bytes, which `torch.load` ignores), so a copied file stays
  verifiable on its own. `read_checkpoint` checks it before `torch.load(weights_only=True)`;
  a corrupt, truncated or foreign file fails with `CheckpointError` naming the file and the
  other checkpoints of the folder to resume from instead.
- `AtomicCheckpointIO` plugs both into Lightning (`trainer.plugins`), so every checkpoint a run
  writes or reads (best, last, evaluation) goes through them.
- `LastCheckpoint` writes `last.ckpt` every N steps and/or every M minutes, at the end of
  training, and when the run is interrupted (SIGINT, SIGTERM, and the requeue signal of a SLURM
  job with auto-requeue), independently of the best checkpoint. It saves only at points a
  resumed run continues exactly from: after the optimizer step, after the step's validation
  when one is due, before the epoch's end. It also keeps what Lightning does not save: the
  epoch-level accumulations of the training metrics, so a resumed epoch logs the same values.

The files are `checkpointing.files`; the Lightning callbacks, `checkpointing.callbacks`.
"""

from megalab.utils.checkpointing.callbacks import (
    BestCheckpoint,
    LastCheckpoint,
    RunInterrupted,
    restore_train_results,
    snapshot_train_results,
)
from megalab.utils.checkpointing.files import (
    LIGHTNING_KEYS,
    TEMP_SUFFIX,
    AtomicCheckpointIO,
    CheckpointError,
    check_lightning_checkpoint,
    content_digest,
    other_checkpoints,
    read_checkpoint,
    remove_stale_temporaries,
    set_verification,
    stored_digest,
    temporary_path,
    verify_checkpoint,
    write_checkpoint,
)

__all__ = [
    "LIGHTNING_KEYS",
    "TEMP_SUFFIX",
    "AtomicCheckpointIO",
    "BestCheckpoint",
    "CheckpointError",
    "LastCheckpoint",
    "RunInterrupted",
    "check_lightning_checkpoint",
    "content_digest",
    "other_checkpoints",
    "read_checkpoint",
    "remove_stale_temporaries",
    "restore_train_results",
    "set_verification",
    "snapshot_train_results",
    "stored_digest",
    "temporary_path",
    "verify_checkpoint",
    "write_checkpoint",
]
