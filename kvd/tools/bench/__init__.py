"""`kvd bench` and its subcommands: ``cli`` (the command line, imported by ``kvd``),
``run`` (the default run: memcpy vs raw NIXL vs kvd end to end), and one module per
measurement. Importing the package loads none of them."""
