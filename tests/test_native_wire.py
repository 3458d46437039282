"""The ClickHouse wire details the SQL endpoint adds to chDB (no broker, no chDB):
CityHash128 v1.0.2 as ClickHouse's checksums use it (vectors from go-faster/city's
CH128, which clickhouse-go checks with), compressed blocks both ways, Native with a
client protocol revision read back by clickhouse-connect, and where the endpoint may
listen."""

from __future__ import annotations

import pytest

from trainmon.consumers.clickhouse.native_wire import (BLOCK_INFO, CompressedDataError, city_hash128,
                                                       compress_blocks, decompress_blocks,
                                                       native_for_revision)
from trainmon.consumers.clickhouse.sql_endpoint import is_loopback, listen_problem, parse_listen

# (length, low, high) of CH128 over bytes (i * 7 + 3) & 255, from github.com/go-faster/city.
CH128 = [
    (0, 4463240938071824939, 4374473821787594281),
    (1, 4122927333511617877, 3094730715364677407),
    (3, 3533349245637716358, 3616421221644656941),
    (4, 2531558843294248001, 14890786202159756685),
    (7, 11455204072341018055, 5298367780255624847),
    (8, 13163314288239264559, 11461100372016334988),
    (9, 6197459901461582234, 17893135339824037871),
    (15, 6521944366256172871, 10277395187798717047),
    (16, 2443093583266065273, 11769618600039628666),
    (17, 924850992982945356, 3656766292061764606),
    (31, 7948695228972695548, 11106905729233393120),
    (32, 7480386089592473577, 9281140549404680686),
    (33, 669839102403533665, 1177458023807482543),
    (64, 15281511294725991151, 6292763485685690900),
    (127, 2241713153362794818, 6726161641425198826),
    (128, 1283538060745198897, 1193376822566313972),
    (129, 3257725840756697816, 6460123419040008788),
    (200, 7781205895143847252, 16388719666018731092),
    (255, 2412478934126683338, 1899309595213378303),
    (256, 9685393237762438219, 11518433994041114030),
    (300, 15433952523931135505, 4018025728861083631),
    (1000, 10973956779846083443, 17791131426744731424),
    (4096, 15528366411797192264, 12024212734245797118),
]


@pytest.mark.parametrize("length, low, high", CH128)
def test_city_hash128_is_clickhouses(length, low, high):
    assert city_hash128(bytes((i * 7 + 3) & 255 for i in range(length))) == (low, high)


@pytest.mark.parametrize("method", ["LZ4", "ZSTD", "NONE"])
def test_compressed_blocks_round_trip_and_checksums(method):
    data = bytes(range(256)) * 5000  # more than one 1 MiB block
    packed = compress_blocks(data, method)
    assert decompress_blocks(packed) == data
    assert decompress_blocks(compress_blocks(b"", method)) == b""
    broken = bytearray(packed)
    broken[40] ^= 0xFF
    with pytest.raises(CompressedDataError):
        decompress_blocks(bytes(broken))


def _leb(n: int) -> bytes:
    return bytes([n])


def _string_column(name: str, type_name: str, data: bytes) -> bytes:
    return _leb(len(name)) + name.encode() + _leb(len(type_name)) + type_name.encode() + data


def test_native_for_revision_adds_block_info_and_serialization_flags():
    clickhouse_connect = pytest.importorskip("clickhouse_connect")
    from clickhouse_connect.driver.query import QueryContext
    from clickhouse_connect.driver.transform import NativeTransform

    # Two blocks of (n UInt8, s String, a Array(Nullable(Int32))), as chDB writes Native.
    def block(values):
        rows = len(values)
        n = bytes(v for v, _, _ in values)
        s = b"".join(_leb(len(t)) + t.encode() for _, t, _ in values)
        offsets, total, nulls, ints = b"", 0, b"", b""
        for _, _, arr in values:
            total += len(arr)
            offsets += total.to_bytes(8, "little")
            nulls += bytes(x is None for x in arr)
            ints += b"".join((x or 0).to_bytes(4, "little", signed=True) for x in arr)
        return (_leb(3) + _leb(rows) + _string_column("n", "UInt8", n) + _string_column("s", "String", s)
                + _string_column("a", "Array(Nullable(Int32))", offsets + nulls + ints))

    values = [(1, "x", [1, None]), (2, "yz", []), (3, "", [-5])]
    raw = block(values[:2]) + block(values[2:])
    assert native_for_revision(raw, 0) == raw
    v1 = native_for_revision(raw, 54405)
    assert v1.startswith(BLOCK_INFO) and v1.count(BLOCK_INFO) == 2

    class Source:
        def __init__(self, data):
            self.gen = iter([data])

        def close(self):
            pass

    from clickhouse_connect.driverc.buffer import ResponseBuffer

    context = QueryContext()
    context.block_info = True
    rows = NativeTransform.parse_response(ResponseBuffer(Source(v1)), context).result_rows
    assert rows == [(1, "x", [1, None]), (2, "yz", []), (3, "", [-5])]
    # From revision 54454 each column's type is followed by a "no custom serialization" byte.
    v2 = native_for_revision(raw, 54460)
    assert len(v2) == len(v1) + 6 and b"\x06String\x00" in v2
    assert clickhouse_connect


def test_where_the_endpoint_may_listen(tmp_path):
    assert parse_listen(None) == ("127.0.0.1", 0)
    assert parse_listen("127.0.0.1:8123") == ("127.0.0.1", 8123)
    assert parse_listen(":9000") == ("127.0.0.1", 9000)
    assert parse_listen("[::1]:8123") == ("::1", 8123)
    assert parse_listen("0.0.0.0") == ("0.0.0.0", 0)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    assert listen_problem("127.0.0.1:8123") is None
    assert "beyond loopback" in listen_problem("0.0.0.0:8123")
    assert "both" in listen_problem("0.0.0.0", tls_cert="c.pem")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    assert listen_problem("0.0.0.0:8443", cert, key) is None
