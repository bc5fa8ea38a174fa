"""``python -m gpustrat``: see :mod:`gpustrat.cli`."""

import sys

from gpustrat.cli import main

if __name__ == "__main__":
    sys.exit(main())
