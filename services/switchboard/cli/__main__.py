"""``python -m switchboard.cli``: the `switchboard` command."""

import sys

from switchboard.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
