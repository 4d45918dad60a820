"""``python -m stratagem`` is the ``stratagem`` command."""

from .cli import main

raise SystemExit(main())
