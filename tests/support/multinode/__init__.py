"""Simulated nodes on one machine (network, mount, IPC and PID namespaces) for the tests
marked ``multinode``: ``harness`` drives them, ``node_agent`` runs inside each node."""
