"""KV-cache block accounting, shared by every simulated engine (:mod:`sim.engine`,
:mod:`sim.fastengine`).

A vPod's KV cache is ``total_blocks = kv_capacity_tokens // block_tokens`` blocks of
``block_tokens`` tokens (vLLM's paged cache); a sequence with ``n`` KV tokens holds
``ceil(n / block_tokens)`` blocks. :class:`KVBlocks` is the one place that spells this out: the
engines inherit it and take (``take``) and give back (``give``) blocks as they admit, grow,
preempt and finish sequences.

Speed: the event-driven engines (:mod:`sim.fastengine`) run millions of requests, so the state
is three slots (``free``, ``bt``, ``total_blocks``) that a hot path may read and update
directly: the paths run per submission, admission, finish or step (and the innermost loops, per
sequence of a batch) spell ``-(-tokens // bt)`` and ``free -= n`` inline rather than calling
:meth:`KVBlocks.blocks_for` / :meth:`KVBlocks.take`, and say so in a comment (a Python call
there costs a few per cent of the cluster simulation's time).
"""

from __future__ import annotations


class KVBlocks:
    """The KV blocks of one vPod: ``free`` of ``total_blocks`` blocks of ``bt`` tokens."""

    __slots__ = ("bt", "total_blocks", "free")

    def __init__(self, kv_capacity_tokens: int, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.bt = block_tokens                               # tokens per block
        self.total_blocks = kv_capacity_tokens // block_tokens
        self.free = self.total_blocks                        # blocks not held by a sequence

    @property
    def block_tokens(self) -> int:
        return self.bt

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens the engine can hold: whole blocks (the vPod's capacity rounded down)."""
        return self.total_blocks * self.bt

    @property
    def free_kv_tokens(self) -> int:
        """KV tokens in free blocks."""
        return self.free * self.bt

    def blocks_for(self, tokens: int) -> int:
        """Blocks holding ``tokens`` KV tokens: ``ceil(tokens / block_tokens)``."""
        return -(-tokens // self.bt)

    def take(self, blocks: int) -> None:
        """Allocate ``blocks`` (the caller has checked that they are free)."""
        self.free -= blocks

    def give(self, blocks: int) -> None:
        """Return ``blocks`` to the free pool."""
        self.free += blocks
