"""How bytes move. ``base``: the protocols the daemon holds this layer by (`Transport`
for NIXL, `Copier` for copies, `Mover` for a pull's bytes) and the values they pass;
``loopback``: an in-process `Transport` for tests. Three parts over ``base`` that never
import each other (tests/test_layers.py): ``remote`` (NIXL READs between daemons),
``copies`` (copies between pools this process maps: DRAM, CUDA) and ``samehost``
(same-host discovery)."""
