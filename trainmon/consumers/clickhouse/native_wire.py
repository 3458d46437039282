"""Bytes the way a ClickHouse server puts them on the wire, for the SQL endpoint.

chDB renders every output format, but two things of ClickHouse's HTTP interface live in
the server, not in the formats:

* ``client_protocol_version=N``: a client that sends it (clickhouse-go always, and
  clickhouse-connect after a probe) reads Native with a block-info header per block
  and, from revision 54454 on, a "custom serialization" flag per column.
  :func:`native_for_revision` adds them to chDB's revision-0 Native, copying each
  column's bytes unchanged (found by size, or by clickhouse-connect's type readers).
* ``compress=1`` / ``decompress=1``: ClickHouse's own compressed blocks (16-byte
  CityHash128 v1.0.2 checksum, method byte, sizes, LZ4 or ZSTD data), which the
  clients check; :func:`compress_blocks` and :func:`decompress_blocks`.
"""

from __future__ import annotations

import struct

_M = (1 << 64) - 1
K0 = 0xC3A5C85C97CB3127
K1 = 0xB492B66FBE98F273
K2 = 0x9AE16A3B2F90404F
K3 = 0xC949D7C7509E6557

# -- CityHash128 v1.0.2 (the version ClickHouse's checksums use) -------------------------


def _f64(s: bytes, i: int) -> int:
    return int.from_bytes(s[i:i + 8], "little")


def _f32(s: bytes, i: int) -> int:
    return int.from_bytes(s[i:i + 4], "little")


def _rot(v: int, shift: int) -> int:
    return v if shift == 0 else ((v >> shift) | (v << (64 - shift))) & _M


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def _h16(u: int, v: int) -> int:
    mul = 0x9DDFEA08EB382D69
    a = ((u ^ v) * mul) & _M
    a ^= a >> 47
    b = ((v ^ a) * mul) & _M
    b ^= b >> 47
    return (b * mul) & _M


def _h0to16(s: bytes, n: int) -> int:
    if n > 8:
        a, b = _f64(s, 0), _f64(s, n - 8)
        return _h16(a, _rot((b + n) & _M, n)) ^ b
    if n >= 4:
        return _h16((n + (_f32(s, 0) << 3)) & _M, _f32(s, n - 4))
    if n > 0:
        y = s[0] + (s[n >> 1] << 8)
        z = n + (s[n - 1] << 2)
        return (_shift_mix(((y * K2) & _M) ^ ((z * K3) & _M)) * K2) & _M
    return K2


def _weak32(s: bytes, i: int, a: int, b: int) -> tuple[int, int]:
    w, x, y, z = _f64(s, i), _f64(s, i + 8), _f64(s, i + 16), _f64(s, i + 24)
    a = (a + w) & _M
    b = _rot((b + a + z) & _M, 21)
    c = a
    a = (a + x + y) & _M
    b = (b + _rot(a, 44)) & _M
    return (a + z) & _M, (b + c) & _M


def _murmur(s: bytes, lo: int, hi: int) -> tuple[int, int]:
    n = len(s)
    a, b = lo, hi
    if n <= 16:
        a = (_shift_mix((a * K1) & _M) * K1) & _M
        c = (b * K1 + _h0to16(s, n)) & _M
        d = _shift_mix((a + (_f64(s, 0) if n >= 8 else c)) & _M)
    else:
        c = _h16((_f64(s, n - 8) + K1) & _M, a)
        d = _h16((b + n) & _M, (c + _f64(s, n - 16)) & _M)
        a = (a + d) & _M
        i, left = 0, n - 16
        while True:
            a ^= (_shift_mix((_f64(s, i) * K1) & _M) * K1) & _M
            a = (a * K1) & _M
            b ^= a
            c ^= (_shift_mix((_f64(s, i + 8) * K1) & _M) * K1) & _M
            c = (c * K1) & _M
            d ^= c
            i += 16
            left -= 16
            if left <= 0:
                break
    a = _h16(a, c)
    b = _h16(d, b)
    return a ^ b, _h16(b, a)


def _city128_seed(s: bytes, lo: int, hi: int) -> tuple[int, int]:
    n = len(s)
    if n < 128:
        return _murmur(s, lo, hi)
    x, y, z = lo, hi, (n * K1) & _M
    v0 = (_rot(y ^ K1, 49) * K1 + _f64(s, 0)) & _M
    v1 = (_rot(v0, 42) * K1 + _f64(s, 8)) & _M
    w0 = (_rot((y + z) & _M, 35) * K1 + x) & _M
    w1 = (_rot((x + _f64(s, 88)) & _M, 53) * K1) & _M
    i, left = 0, n
    while left >= 128:
        for off in (0, 64):
            p = i + off
            x = (_rot((x + y + v0 + _f64(s, p + 16)) & _M, 37) * K1) & _M
            y = (_rot((y + v1 + _f64(s, p + 48)) & _M, 42) * K1) & _M
            x ^= w1
            y ^= v0
            z = _rot(z ^ w0, 33)
            v0, v1 = _weak32(s, p, (v1 * K1) & _M, (x + w0) & _M)
            w0, w1 = _weak32(s, p + 32, (z + w1) & _M, y)
            z, x = x, z
        i += 128
        left -= 128
    y = (y + _rot(w0, 37) * K0 + z) & _M
    x = (x + _rot((v0 + z) & _M, 49) * K0) & _M
    done = 0
    while done < left:
        done += 32
        y = (_rot((y - x) & _M, 42) * K0 + v1) & _M
        w0 = (w0 + _f64(s, n - done + 16)) & _M
        x = (_rot(x, 49) * K0 + w0) & _M
        w0 = (w0 + v0) & _M
        v0, v1 = _weak32(s, n - done, v0, v1)
    x = _h16(x, v0)
    y = _h16(y, w0)
    return (_h16((x + v1) & _M, w1) + y) & _M, _h16((x + w1) & _M, (y + v1) & _M)


def city_hash128(data: bytes) -> tuple[int, int]:
    """CityHash128 v1.0.2 of ``data`` as (low, high) 64-bit halves."""
    n = len(data)
    if n >= 16:
        return _city128_seed(data[16:], _f64(data, 0) ^ K3, _f64(data, 8))
    if n >= 8:
        return _city128_seed(b"", _f64(data, 0) ^ ((n * K0) & _M), _f64(data, n - 8) ^ K1)
    return _city128_seed(data, K0, K1)


# -- ClickHouse compressed blocks --------------------------------------------------------

LZ4, ZSTD, NONE = 0x82, 0x90, 0x02
METHODS = {"LZ4": LZ4, "ZSTD": ZSTD, "NONE": NONE}
BLOCK = 1 << 20  # ClickHouse's max_compress_block_size


def _zstd():
    from clickhouse_connect.driver.compression import _require_zstd

    return _require_zstd()


def compress_blocks(data: bytes, method: str = "LZ4", level: int | None = None) -> bytes:
    """``data`` as ClickHouse's compressed blocks (what ``compress=1`` answers)."""
    import lz4.block

    code = METHODS.get(method.upper(), LZ4)
    out = bytearray()
    for start in range(0, max(len(data), 1), BLOCK):
        chunk = data[start:start + BLOCK]
        if code == LZ4:
            packed = lz4.block.compress(chunk, store_size=False)
        elif code == ZSTD:
            packed = _zstd().compress(chunk, level) if level else _zstd().compress(chunk)
        else:
            packed = bytes(chunk)
        body = struct.pack("<BII", code, len(packed) + 9, len(chunk)) + packed
        lo, hi = city_hash128(body)
        out += struct.pack("<QQ", lo, hi) + body
        if not data:
            break
    return bytes(out)


class CompressedDataError(ValueError):
    """The body is not ClickHouse compressed blocks, or a checksum does not match."""


def decompress_blocks(data: bytes) -> bytes:
    """The inverse of :func:`compress_blocks`, checksums checked (``decompress=1``)."""
    import lz4.block

    out = bytearray()
    pos = 0
    while pos < len(data):
        if len(data) - pos < 25:
            raise CompressedDataError("truncated compressed block header")
        lo, hi = struct.unpack_from("<QQ", data, pos)
        code, size, raw_size = struct.unpack_from("<BII", data, pos + 16)
        body = data[pos + 16:pos + 16 + size]
        if len(body) != size:
            raise CompressedDataError("truncated compressed block")
        if city_hash128(body) != (lo, hi):
            raise CompressedDataError("checksum doesn't match: corrupted data")
        packed = body[9:]
        if code == LZ4:
            out += lz4.block.decompress(packed, uncompressed_size=raw_size)
        elif code == ZSTD:
            out += _zstd().decompress(packed)
        elif code == NONE:
            out += packed
        else:
            raise CompressedDataError(f"unknown compression method 0x{code:02x}")
        pos += 16 + size
    return bytes(out)


# -- Native with a client protocol revision ----------------------------------------------

REVISION_WITH_BLOCK_INFO = 1
REVISION_WITH_CUSTOM_SERIALIZATION = 54454
# BlockInfo as the server writes it: field 1 is_overflows = false, field 2 bucket_num = -1, end.
BLOCK_INFO = b"\x01\x00\x02\xff\xff\xff\xff\x00"


_FIXED = {"UInt8": 1, "Int8": 1, "Bool": 1, "Enum8": 1, "UInt16": 2, "Int16": 2, "Enum16": 2,
          "Date": 2, "BFloat16": 2, "UInt32": 4, "Int32": 4, "Float32": 4, "Date32": 4,
          "DateTime": 4, "IPv4": 4, "Decimal32": 4, "Time": 4, "UInt64": 8, "Int64": 8,
          "Float64": 8, "DateTime64": 8, "Decimal64": 8, "Time64": 8, "UInt128": 16,
          "Int128": 16, "UUID": 16, "IPv6": 16, "Decimal128": 16, "UInt256": 32, "Int256": 32,
          "Decimal256": 32}


def _fixed_size(type_name: str) -> int | None:
    base, _, args = type_name.partition("(")
    if base == "Decimal":
        precision = int(args.split(",")[0])
        return 4 if precision <= 9 else 8 if precision <= 18 else 16 if precision <= 38 else 32
    if base == "FixedString":
        return int(args.rstrip(")"))
    if base.startswith("Interval"):
        return 8
    return _FIXED.get(base)


def _skip_strings(data: bytes, pos: int, rows: int) -> int:
    for _ in range(rows):
        size = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        pos += size
    return pos


def _column_end(data: bytes, pos: int, type_name: str, rows: int) -> int:
    """Where a column of ``rows`` values of ``type_name`` starting at ``pos`` ends."""
    size = _fixed_size(type_name)
    if size is not None:
        return pos + size * rows
    if type_name == "String":
        return _skip_strings(data, pos, rows)
    if type_name.startswith("Nullable(") and not type_name.startswith("Nullable(Nothing"):
        inner = type_name[9:-1]
        if inner == "String" or _fixed_size(inner) is not None:
            return _column_end(data, pos + rows, inner, rows)
    return _column_end_parsed(data, pos, type_name, rows)


class _ByteAtATime:
    """A source for clickhouse-connect's (C) reader, one byte a chunk, counting what it
    hands out: the reader then holds nothing read ahead, so the count is its position."""

    def __init__(self, data: bytes, pos: int):
        self.data, self.pos = data, pos
        self.gen = self._bytes()

    def _bytes(self):
        data = self.data
        while self.pos < len(data):
            self.pos += 1
            yield data[self.pos - 1:self.pos]

    def close(self):
        pass


def _column_end_parsed(data: bytes, pos: int, type_name: str, rows: int) -> int:
    from clickhouse_connect.datatypes import registry
    from clickhouse_connect.driver.buffer import ResponseBuffer as PyBuffer
    from clickhouse_connect.driver.ctypes import data_conv
    from clickhouse_connect.driver.query import QueryContext

    try:
        from clickhouse_connect.driverc.buffer import ResponseBuffer
    except ImportError:
        ResponseBuffer = PyBuffer
    if getattr(data_conv, "__name__", "").endswith("driver.dataconv"):
        ResponseBuffer = PyBuffer  # the pure-Python readers take the Python buffer
    source = _ByteAtATime(data, pos)
    registry.get_from_name(type_name).read_column(ResponseBuffer(source), rows, QueryContext())
    return source.pos


def leb128(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def native_for_revision(data: bytes, revision: int) -> bytes:
    """chDB's Native (revision 0) as a server writes it for ``client_protocol_version``."""
    if revision <= 0 or not data:
        return data
    out = bytearray()
    pos = 0

    def leb128() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    while pos < len(data):
        start = pos
        columns, rows = leb128(), leb128()
        out += BLOCK_INFO + data[start:pos]
        for _ in range(columns):
            start = pos
            size = leb128()  # the name
            pos += size
            size = leb128()
            type_name = data[pos:pos + size].decode()
            pos += size
            out += data[start:pos]
            if revision >= REVISION_WITH_CUSTOM_SERIALIZATION:
                out += b"\x00"
            if rows:
                start = pos
                pos = _column_end(data, pos, type_name, rows)
                out += data[start:pos]
    return bytes(out)
