"""``python -m p2pfl.cli``: the ``p2pfl`` command."""

from p2pfl.cli.main import main

main()
