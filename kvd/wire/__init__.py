"""What crosses a socket: the message schema (``protocol``), its one decode boundary
(``codec``) and the bounded peek at a frame before decoding (``peek``).

Above the planner and transport, below pools, client, ops and daemon.
"""
