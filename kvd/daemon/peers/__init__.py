"""Other daemons: the handshakes and the peer cache with its identity rules (`table`), and
one connection per daemon with its replies and liveness (`conn`)."""
