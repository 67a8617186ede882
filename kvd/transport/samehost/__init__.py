"""Same-host discovery: is a peer daemon on this host, can its DRAM pools be mapped
here, is an address us? (``discovery``). Pure standard library: no copy, no NIXL.
"""
