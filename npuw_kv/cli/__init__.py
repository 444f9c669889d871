"""``npuw-kv``: the command line (:mod:`.commands` holds the entry point)."""
