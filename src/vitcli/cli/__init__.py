"""`vit`, the command line: it parses, resolves the recipe under the command's stage and hands over
to the stage; nothing here imports torch at the top, so `vit --help` is instant.

- `options.py`: every option and argument, declared once (closed choices as types);
- `dispatch.py`: the recipe resolved, and the one dispatcher every command hands its stage function
  to (dry run, default workdir, JSON or CSV on rank 0);
- `commands.py`: the Typer app, each command parsing its flags and handing over;
- `entry.py`: `main()`, which makes every ending an exit code and at most one line;
- `__main__.py`: `python -m vitcli.cli`, as torchrun runs it.
"""

from vitcli.cli.commands import COMMANDS, app
from vitcli.cli.entry import main

__all__ = ["COMMANDS", "app", "main"]
