"""`vit env`: this machine and process in one block to paste into a bug report (as `accelerate
env` gives accelerate's): what runtime.environment reads, as Markdown bullets that read the same in
a terminal and in a GitHub issue; secrets redacted there."""

from __future__ import annotations

from vitcli.runtime.environment import report
from vitcli.runtime.metrics import stdout


def lines(section: dict, indent: int = 0) -> list[str]:
    """A report's sections as nested Markdown bullets: a dict's keys, a list of dicts one item per
    line, a list of names on one line."""
    pad, out = "  " * indent, []
    for key, value in section.items():
        if isinstance(value, dict) and value:
            out += [f"{pad}- {key}:", *lines(value, indent + 1)]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            out += [f"{pad}- {key}:"]
            out += [f"{pad}  - " + ", ".join(f"{k}: {v}" for k, v in i.items()) for i in value]
        else:
            shown = ", ".join(map(str, value)) if isinstance(value, list | dict) else value
            out.append(f"{pad}- {key}: {'none' if shown in ('', None) else shown}")
    return out


def env() -> dict:
    """Print the report (stdout, plain text: no markup, never wrapped) and return it for --json."""
    found = report()
    title = "vit env (paste into a bug report; secrets are redacted)"
    stdout.print("\n".join([title, *lines(found)]), markup=False, highlight=False, soft_wrap=True)
    return found
