"""Errors a user can fix, and the exit codes the launchers and Kubernetes act on.

Exit codes follow the convention of Kubeflow's `restartPolicy: ExitCode`:
1-127 are permanent (restarting cannot help), 128-255 are retryable.
"""

# Bad flags, bad cluster spec, missing data, mismatched checkpoint: a restart
# would fail the same way, so the code must be permanent.
EXIT_USAGE = 2
# The loss diverged; the last good checkpoint is kept. Permanent: retrying at
# the same learning rate diverges again.
EXIT_DIVERGED = 3
# Stopped by SIGTERM/SIGINT after saving a checkpoint (128 + SIGTERM). A
# restart resumes from that checkpoint, so the code must be retryable.
EXIT_PREEMPTED = 143
# A peer of a multi-worker job was lost mid-training (128 + SIGPIPE: the
# connection broke). Retryable: the group restarts from the last checkpoint.
EXIT_PEER_LOST = 141
# Peers of a multi-worker job did not come up in time: peer_watchdog ends
# the worker with SIGALRM (a shell and Kubernetes see 128 + 14). Retryable: the peers may
# still be scheduled.
EXIT_PEER_TIMEOUT = 142
# Ctrl-C pressed twice: aborted at once, without a checkpoint (128 + SIGINT,
# as a shell reports a process that Ctrl-C ended).
EXIT_ABORTED = 130
# A multi-worker worker signalled while it waited for its peers is ended by
# peer_watchdog with SIGKILL (128 + 9): retryable, nothing was trained yet.
# Another run holds --model_dir. Retryable: on Kubernetes this is a
# replacement chief waiting for a lost node's NFS lock to expire (about
# 90 s), and a restart with backoff gets the directory once it has.
EXIT_MODEL_DIR_BUSY = 144


class UserError(Exception):
    """An error caused by input the user controls; printed as one line."""

    exit_code = EXIT_USAGE


class ConfigError(UserError):
    """A flag is missing, malformed or contradicts another flag."""


class ClusterError(UserError):
    """The cluster description (TF_CONFIG, indexed Job, SLURM) is unusable."""


class DataUnavailableError(UserError):
    """The dataset is not in --data_dir, is damaged there, or cannot be downloaded."""


class CheckpointMismatchError(UserError):
    """--model_dir holds checkpoints of a different model."""


class DivergedError(UserError):
    """The loss became NaN or infinite and did not recover."""

    exit_code = EXIT_DIVERGED


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint."""

    exit_code = EXIT_PREEMPTED
