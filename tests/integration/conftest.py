"""The integration suite: kvd daemons as real processes on loopback.

Its ``pair`` fixture is the root one (tests/conftest.py), shared with the fault suite.
"""
