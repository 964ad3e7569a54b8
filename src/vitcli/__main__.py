"""`python -m vitcli` (and `torchrun -m vitcli`): the `vit` command line."""

from vitcli.cli import main

main()
