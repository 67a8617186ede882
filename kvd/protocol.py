"""One-release alias: the schema moved to ``kvd.wire.protocol``.

Kept so engines and tools written against ``kvd.protocol`` keep working for one
release; ``kvd.protocol is kvd.wire.protocol``. New code imports ``kvd.wire.protocol``.
"""

import sys

from kvd.wire import protocol as _protocol

sys.modules[__name__] = _protocol
