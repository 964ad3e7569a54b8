"""Calling the real `vit` entry point in-process, as the tests of every command do."""

import sys

from vitcli import cli


def run_vit(monkeypatch, capsys, *args):
    """Run `vit ARGS...` through cli.main(); return (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["vit", *map(str, args)])
    monkeypatch.delenv("VITCLI_DEBUG", raising=False)
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err
