"""`python -m vitcli.cli` (and `torchrun -m vitcli.cli`): the `vit` command line."""

from vitcli.cli import main

main()
