"""``python -m npuw_kv.cli``: the same as the ``npuw-kv`` command."""

from .commands import main

raise SystemExit(main())
