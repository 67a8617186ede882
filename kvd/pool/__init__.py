"""KV memory: the pools a daemon creates and registers (``shm``, ``cuda``), how an engine
maps them (``mapping``), who owns a pool file and the reaping of crash leftovers
(``owner``), and the geometry of hybrid pools and the engine's per-group views of them
(``hybrid``, ``hybrid_views``).

Above the planner and the wire (pool geometry is planned, handles are wire structs),
below client, ops and daemon.
"""
