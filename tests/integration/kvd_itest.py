"""Kept for modules that still import ``kvd_itest``: the helpers live in support.cluster."""

from support.cluster import *  # noqa: F403
