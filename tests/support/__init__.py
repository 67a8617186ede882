"""Helpers shared by the test suites (never imported by kvd itself)."""
