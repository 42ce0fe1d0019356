"""Sequence-length and batch-size buckets (paper §3.3).

Sequence lengths: 128-token steps up to 1024, then the step doubles at every power of two
(256 up to 2048, 512 up to 4096, ...), i.e. four buckets per octave, up to 1M = 2^20 tokens:
8 + 10 * 4 = 48 buckets. A bucket is named by its upper edge, and a length L falls in the first
bucket whose upper edge is >= L. The DSE evaluates each bucket at its upper edge (the worst case
inside the bucket, so the SLO and memory checks hold for every length in it).

Batch sizes: powers of two below 16, multiples of 16 from 16 to 1024 (vLLM-style).
"""

from __future__ import annotations

from bisect import bisect_left

from .errors import NeuScaleError

MAX_SEQ_LEN = 1 << 20


def _seq_bucket_edges(max_len: int = MAX_SEQ_LEN) -> tuple[int, ...]:
    edges = list(range(128, 1024 + 1, 128))
    lo = 1024
    while lo < max_len:
        step = lo // 4
        edges.extend(range(lo + step, 2 * lo + 1, step))
        lo *= 2
    return tuple(edges)


SEQ_BUCKETS: tuple[int, ...] = _seq_bucket_edges()
NUM_SEQ_BUCKETS = len(SEQ_BUCKETS)  # 48


def bucket_index(seq_len: int) -> int:
    """Index of the bucket holding ``seq_len`` (1 <= seq_len <= 1M)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        try:
            seq_len = int(seq_len)
        except (TypeError, ValueError):
            raise NeuScaleError(f"sequence length must be an integer (got {seq_len!r})") from None
    if seq_len < 1:
        raise NeuScaleError(f"sequence length must be >= 1 token (got {seq_len})")
    if seq_len > MAX_SEQ_LEN:
        raise NeuScaleError(f"sequence length {seq_len} exceeds the largest bucket "
                            f"({MAX_SEQ_LEN} tokens)")
    return bisect_left(SEQ_BUCKETS, seq_len)


def bucket_of(seq_len: int) -> int:
    """Upper edge of the bucket holding ``seq_len``."""
    return SEQ_BUCKETS[bucket_index(seq_len)]


def batch_buckets(max_batch: int = 1024) -> tuple[int, ...]:
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    return tuple(small + list(range(16, max_batch + 1, 16)))


BATCH_BUCKETS: tuple[int, ...] = batch_buckets()
