"""Read the request id of a msgpack header that does not decode.

An Error about a malformed header must still reach the call that sent it, so
the daemon reads ``id`` from the top-level map alone: iteratively (no recursion,
whatever the nesting), within the header size bound, ignoring the other fields'
types. Pure bytes; no msgspec.
"""

from __future__ import annotations


def peek_id(frame: bytes, max_bytes: int) -> int:
    """``id`` of a top-level msgpack map if it is a non-negative int, else 0."""
    if len(frame) > max_bytes:
        return 0
    try:
        return _peek_id(frame)
    except (IndexError, ValueError):
        return 0


def _peek_id(b: bytes) -> int:
    pos, n = _map_len(b, 0)
    for _ in range(n):
        key, pos = _str_at(b, pos)
        if key == "id":
            value = _int_at(b, pos)
            return value if 0 <= value < 2**63 else 0
        pos = _skip(b, pos)
    return 0


def _be(b: bytes, pos: int, size: int) -> int:
    if pos + size > len(b):
        raise IndexError("truncated")
    return int.from_bytes(b[pos:pos + size], "big")


def _map_len(b: bytes, pos: int) -> tuple[int, int]:
    t = b[pos]
    if 0x80 <= t <= 0x8F:
        return pos + 1, t & 0x0F
    if t in (0xDE, 0xDF):
        size = 2 if t == 0xDE else 4
        return pos + 1 + size, _be(b, pos + 1, size)
    raise ValueError("not a map")


def _str_at(b: bytes, pos: int) -> tuple[str, int]:
    t = b[pos]
    if 0xA0 <= t <= 0xBF:
        start, n = pos + 1, t & 0x1F
    elif t in (0xD9, 0xDA, 0xDB):
        size = {0xD9: 1, 0xDA: 2, 0xDB: 4}[t]
        start, n = pos + 1 + size, _be(b, pos + 1, size)
    else:
        return "", _skip(b, pos)  # a non-string key: skip it, it is not "id"
    return b[start:start + n].decode("utf-8", "replace"), start + n


def _int_at(b: bytes, pos: int) -> int:
    t = b[pos]
    if t <= 0x7F:
        return t
    if t in (0xCC, 0xCD, 0xCE, 0xCF):
        return _be(b, pos + 1, {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}[t])
    return -1


# Fixed sizes after the type byte; containers and length-prefixed types are handled apart.
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
          0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_LEN_PREFIXED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1),
                 0xC9: (4, 1), 0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _skip(b: bytes, pos: int) -> int:
    """Position after one msgpack value, walked with a counter instead of recursion."""
    pending = 1
    while pending:
        pending -= 1
        t = b[pos]
        if t <= 0x7F or t >= 0xE0:
            pos += 1
        elif t <= 0x8F:
            pending += 2 * (t & 0x0F)
            pos += 1
        elif t <= 0x9F:
            pending += t & 0x0F
            pos += 1
        elif t <= 0xBF:
            pos += 1 + (t & 0x1F)
        elif t in _FIXED:
            pos += 1 + _FIXED[t]
        elif t in _LEN_PREFIXED:
            size, ext = _LEN_PREFIXED[t]
            pos += 1 + size + ext + _be(b, pos + 1, size)
        elif t in _CONTAINERS:
            size, per = _CONTAINERS[t]
            pending += per * _be(b, pos + 1, size)
            pos += 1 + size
        else:
            raise ValueError(f"invalid msgpack type byte {t:#x}")
        if pos > len(b):
            raise IndexError("truncated")
    return pos
