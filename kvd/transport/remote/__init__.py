"""Reads from another daemon's pools over NIXL (the "remote" path of a pull).

``nixl``: the `Transport` over a real NIXL agent (UCX); ``prepped``: READs through
prepared descriptor lists; ``workers``, ``split``, ``rails``: a READ split by bytes over
several posting agents, one per rail; ``sockets``: severing a peer's connections;
``ucx_heap``: the zeroed heap that keeps a producer alive when a consumer severs.
Importing this package loads no NIXL: only ``nixl.import_nixl`` does, when called.
"""
