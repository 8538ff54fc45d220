"""``python -m iga_ds``: the ``iga-ds`` command without an installed entry point."""
import sys

from iga_ds.cli import main

sys.exit(main())
