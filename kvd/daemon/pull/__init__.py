"""A consumer's pulls: the state table (`state`), the sans-IO pull (`machine`), the rules
judging its Acquire (`acquire`), the movers that carry its bytes (`movers`), the driver
that carries its actions out (`driver`), the quarantine bounds (`quarantine`), and the
consumer that admits pulls and picks their movers (`consumer`)."""
