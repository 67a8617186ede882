"""`kvd demo`: two daemons and simulated engines on loopback, checked byte for byte
(``run``)."""
