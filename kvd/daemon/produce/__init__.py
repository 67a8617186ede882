"""The producer side: publish, acquire, READ notices, leases (`producer`), and each held
request's lease and reader counts as a pure state machine (`held`)."""
