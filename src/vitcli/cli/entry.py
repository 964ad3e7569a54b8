"""`vit`'s entry point: every way a command ends becomes its exit code and at most one line. A
return is 0; bad input (a VitcliError, a usage error) one red line and 2; Ctrl-C 130 and SIGTERM
143, one plain line (a stop asked for is no error) saying what is kept; a bug one line and 1
(VITCLI_DEBUG=1 shows the traceback). Under torchrun rank 0 alone prints the line, and every rank
leaves it in torchrun's error file."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import typer

from vitcli.cli.commands import COMMANDS, app
from vitcli.errors import Interrupted, Terminated, VitcliError
from vitcli.runtime.allocator import keep_freed_memory
from vitcli.runtime.launcher import LaunchEnv

# What a stop outside the training loop leaves (the loop's own stop writes a checkpoint and says
# so): every file is written under a temporary name and renamed when whole, and the temporary ones
# are removed on the way out (runtime.files), so what a command had finished stays and nothing
# half-written is left
KEPT = "what was finished is kept, nothing half-written is left"


def main() -> None:
    """Entry point: known errors become one red line (rank 0's alone) and exit 2; VITCLI_DEBUG=1
    shows tracebacks."""
    debug = os.environ.get("VITCLI_DEBUG") == "1"
    # large tensors reused, not faulted in afresh every step (runtime/allocator.py)
    keep_freed_memory()
    # unwind (temporary files removed) rather than die mid-write
    # a scheduler's stop, or its warning
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, _terminate)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        with _process_group():
            # Typer turns Ctrl-C into this return value: not success
            if app(standalone_mode=False) == 130:
                raise KeyboardInterrupt
    except Interrupted as e:  # the loop's own stop, its checkpoint written: said, not an error
        _stop(str(e), e.exit_code)
    except VitcliError as e:
        if debug:
            raise
        _fail(str(e), e.exit_code)
    except typer.TyperException as e:  # Typer's own copy of click: a usage error, named in one line
        _usage_error(e)
    except (typer.Abort, KeyboardInterrupt):
        _stop(f"interrupted (Ctrl-C); {KEPT}", 130)
    except Terminated:
        code, what = _STOPPED[0] if _STOPPED else (143, "terminated (SIGTERM)")
        _stop(f"{what}; {KEPT}", code)
    except Exception as e:  # a bug: still one line unless debugging
        if _STOPPED:  # what a signal turned into on its way up (an import it cut short): the stop
            _stop(f"{_STOPPED[0][1]}; {KEPT}", _STOPPED[0][0])
        if debug:
            raise
        _fail(f"{type(e).__name__}: {e} (set VITCLI_DEBUG=1 for the traceback)", 1)


@contextlib.contextmanager
def _process_group():
    """The command owns the process group a stage joins (runtime.dist.setup): it is left on every
    way out, a return, an error, Ctrl-C or SIGTERM (raised as Terminated). runtime.dist, and torch
    with it, is asked only if a stage imported it, so `vit --help` stays without torch."""
    try:
        yield
    except BaseException as e:
        if LaunchEnv.read().world_size > 1 or isinstance(e, Interrupted):
            # The outcome is decided: torchrun's SIGTERM to the ranks still running, once one has
            # exited with an error, or a scheduler's signal again (it reaches a process more than
            # once), would only cut short the leaving and the report
            for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(signum, signal.SIG_IGN)
        # an agreed stop (Interrupted) finds every rank at the same step: they leave as on a return
        _leave(failed=not isinstance(e, Interrupted))
        raise
    _leave(failed=False)


def _leave(failed: bool) -> None:
    """runtime.dist.leave, if a stage imported runtime.dist (else there is no group to leave)."""
    dist = sys.modules.get("vitcli.runtime.dist")
    if dist is not None:
        dist.leave(failed)


# (exit code, what): the signal that stopped the command, once one did
_STOPPED: list[tuple[int, str]] = []


def _terminate(signum, frame) -> None:
    _STOPPED.append((128 + signum, f"terminated ({signal.Signals(signum).name})"))
    raise Terminated


def _interrupt(signum, frame) -> None:
    """Ctrl-C, remembered: a KeyboardInterrupt raised inside an import can come out as another error
    (ModuleNotFoundError, seen at 0.3 s into `vit prepare-data`), which must still exit 130."""
    _STOPPED.append((130, "interrupted (Ctrl-C)"))
    raise KeyboardInterrupt


def _usage_error(e: Exception) -> None:
    """`No such option: --recipy`, `Invalid value for '--res': ...` as one line with where to look,
    exit 2."""
    message = e.format_message().strip()
    if not message:  # a bare `vit`: the help was just printed, which is the answer
        sys.exit(2)
    command = next((a for a in sys.argv[1:] if a in COMMANDS), "")
    where = f"vit {command} --help" if command else "vit --help"
    _fail(f"{message}{_ckpt_hint(e, command)} (see `{where}`)", 2)


def _ckpt_hint(e: Exception, command: str) -> str:
    """For a missing --ckpt after a bare first word: a checkpoint given by position (as `vit inspect
    RUN` and `vit resize-posemb RUN` once took it), and the command line that names it."""
    rest = sys.argv[sys.argv.index(command) + 1:] if command else []
    missing = getattr(getattr(e, "param", None), "name", None)
    if missing != "ckpt" or not rest or rest[0].startswith("-") or "=" in rest[0]:
        return ""  # an option, or a KEY=VALUE override
    return (" The checkpoint is named by --ckpt, not by position: "
            f"`vit {command} --ckpt {rest[0]} ...`")


def _fail(message: str, code: int) -> None:
    """`message` as one red line on stderr, then exit `code`. Under torchrun every rank meets the
    same error (the same recipe and data, the same agreed step), so rank 0 alone prints it; each
    rank also leaves it in torchrun's error file, where torchrun's failure summary shows it (an
    error one rank met alone is named there too)."""
    _say("[bold red]error:[/] ", message, code)


def _stop(message: str, code: int) -> None:
    """A stop that Ctrl-C or a scheduler's SIGTERM asked for, as one plain yellow line: not an
    error, though its exit code (130, 143) tells a script it did not finish. Told as `_fail` tells
    an error. A scheduler's signal that comes again now changes nothing."""
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    _say("[yellow]", message, code)


def _say(prefix: str, message: str, code: int) -> None:
    _tell_torchrun(message)
    if LaunchEnv.read().is_main:
        from rich.console import Console
        from rich.markup import escape

        # escaped: a message's own brackets (pip install 'vitcli[export]') are text, not rich markup
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"{prefix}{escape(message)}")
    sys.exit(code)


def _tell_torchrun(message: str) -> None:
    """`message` in the error file torchrun gives each worker (TORCHELASTIC_ERROR_FILE), which its
    summary of failed workers shows in place of its hint "To enable traceback see: ...". The layout
    is the one torch's own ErrorHandler.record_exception writes, with our one line where it puts the
    Python traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    # a file that cannot be written loses only the summary's line: the exit code tells the failure
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": info}}, f)
