"""A consumer's pulls: the state table and the enums of a pull's record (`state`), the
sans-IO pull (`machine`), what happens to it (`inputs`, fed to `Pull.handle`) and the
actions it returns (`actions`), the rules judging its Acquire (`acquire`) and the
Acquire in flight (`acquiring`), the descriptors it assembles (`assemble`), the movers
that carry its bytes (`movers`: NIXL READs; `local`: copies between this daemon's pools;
`hostmap`: another same-host daemon's pool files mapped here), the driver that carries
its actions out (`driver`), the quarantine bounds (`quarantine`), and the consumer that
admits pulls and picks their movers (`consumer`)."""
