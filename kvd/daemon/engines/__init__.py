"""This daemon's engines: what each is (`table`: ranks, pins, epochs, validation, pure),
registration, allocation and pool freeing (`registry`), and which connection belongs to
which engine rank (`liveness`)."""
