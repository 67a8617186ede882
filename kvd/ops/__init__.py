"""What operators see: Prometheus metrics and their docs, the HTTP server for
``/metrics``, ``/livez`` and ``/readyz``, log set-up, and ``kvd status``.

Above client (``status`` asks a daemon through it), below the daemon, which reports
through ``metrics`` and serves ``httpserver``.
"""
