"""``python -m xds``: the same as the ``xds`` command."""

from .cli.main import main

raise SystemExit(main())
