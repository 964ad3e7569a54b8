"""Typed errors. Each carries a one-line message that names the culprit and, where possible, the
fix.

The CLI turns any `VitcliError` into one red line on stderr and exit code 2 (bad input); anything
else is a bug and exits 1. Set VITCLI_DEBUG=1 to see the traceback.
"""

# A rank the watchdog (train/watchdog.py) found stalled in a step or a collective exits with this
# code, after dumping every thread's stack: sysexits' EX_TEMPFAIL ("a temporary failure; the user is
# invited to retry"), so torchrun's --max-restarts and the SLURM job's requeue rule
# (cluster/requeue.py) can tell a hang, which a restart may cure, from a bug's exit 1.
HUNG_EXIT_CODE = 75


class VitcliError(Exception):
    """Base of every error caused by the user's input rather than by a bug."""

    exit_code = 2


class RecipeError(VitcliError):
    """A recipe key is unknown, has the wrong type, or contradicts another key."""


class ModelError(VitcliError):
    """An unknown model name or an impossible architecture."""


class DataError(VitcliError):
    """A dataset that cannot be found, read, or used as configured."""


class CheckpointError(VitcliError):
    """A checkpoint that is missing, unsafe to read, or does not fit the model."""


class OutputError(VitcliError):
    """A workdir or output path that cannot be written, or a finished run that would be replaced."""


class Interrupted(VitcliError):
    """Training stopped on a signal after writing a checkpoint; exit 130 (SIGINT) or 143 (SIGTERM),
    its line plain, not an error's (cli.entry)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Terminated(BaseException):
    """SIGTERM outside the training loop: unwinds like KeyboardInterrupt (so temporary files are
    removed)."""


class TrainingError(VitcliError):
    """Training cannot go on (for example a non-finite loss)."""


class TrackingError(VitcliError):
    """An experiment tracker (run.loggers) that cannot be reached or opened at a run's start."""


class ClusterError(VitcliError):
    """A run that cannot be handed to the cluster: no sbatch here, or sbatch refused the job (its
    line)."""


def first_line(error: BaseException, *, named: bool = False) -> str:
    """The first line of `error`'s message that is not blank, stripped (torch's, PIL's and datasets'
    messages run to many lines; a one-line error quotes one), or the error's class name when its
    message is empty. `named`: `Type: line`, the class name alone for an empty message."""
    line = next((text.strip() for text in str(error).splitlines() if text.strip()), "")
    if not line:
        return type(error).__name__
    return f"{type(error).__name__}: {line}" if named else line
