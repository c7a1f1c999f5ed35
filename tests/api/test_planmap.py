"""The plan ConfigMap's decoding is bounded: a gzip bomb is refused without being inflated."""

from __future__ import annotations

import base64
import gzip
import tracemalloc
import zlib

import pytest

from oobleck.api.planmap import MAX_PLAN_BYTES, PLAN_GZ_KEY, gunzip_capped, read_plan


def _zeros_gzipped(size: int) -> bytes:
    stream = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = b"\0" * (1 << 20)
    return b"".join([*(stream.compress(chunk) for _ in range(size >> 20)), stream.flush()])


def test_a_gzip_bomb_in_the_plan_config_map_is_refused_naming_the_cap():
    bomb = _zeros_gzipped(512 << 20)  # 512 MiB of zeros in about half a megabyte
    assert len(bomb) < 1 << 20
    config_map = {"metadata": {"name": "tiny-plan"}, "binaryData": {PLAN_GZ_KEY: base64.b64encode(bomb).decode()}}
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as raised:
            read_plan(config_map)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(raised.value)
    assert "configmap tiny-plan: key plan.json.gz" in message and f"cap of {MAX_PLAN_BYTES} bytes" in message
    assert peak < 3 * MAX_PLAN_BYTES, f"{peak >> 20} MiB held decoding a bomb"


def test_the_cap_is_exact_and_truncated_data_is_an_error():
    assert gunzip_capped(gzip.compress(b"abc"), 3) == b"abc"
    with pytest.raises(ValueError, match="more than the cap of 3 bytes"):
        gunzip_capped(gzip.compress(b"abcd"), 3)
    with pytest.raises(ValueError, match="truncated"):
        gunzip_capped(gzip.compress(b"abcd" * 100)[:-8], 1000)
