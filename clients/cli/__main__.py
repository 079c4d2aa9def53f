"""``python -m clients.cli``: the ``loraplane`` command line (`clients.cli.main.main`)."""

from clients.cli.main import main

main()
