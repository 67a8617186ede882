"""The ``kvd`` commands besides ``serve``, each in a package named for it.

These are part of the product a user installs, but nothing a running daemon needs:

- ``router``: ``kvd router``, an OpenAI-compatible prefill/decode router for vLLM;
- ``bench``: ``kvd bench`` and its subcommands (``cli`` is the command line);
- ``plan``: ``kvd plan``, what a pull between two engine shapes would read;
- ``tiny_model``: ``kvd tiny-model DIR``, a tiny Llama that vLLM loads (quickstart, tests);
- ``demo``: ``kvd demo``, two daemons and simulated engines on loopback, byte-exact;

and the harness they share (also used by the tests):

- ``sim``: simulated engines that write and check the global KV pattern in any layout;
- ``localcluster``: start and stop ``kvd serve`` processes locally.

The layer sits above the daemon and the connector (tests/test_layers.py): no module
below imports it, ``kvd.cli`` imports each command lazily, and its modules use only
public names of the rest of kvd and of one another.
"""
