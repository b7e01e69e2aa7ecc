"""Corner Shop: the small SQLite web shop behind the ``webarena_local`` tasks."""
