"""What it costs to act on a vPod (paper Table 3): the delays of creating, starting, loading and
deleting one, of reading runtime statistics, and of moving KV between vPods over DCN.

The cluster simulator draws these in virtual time; the simulated backend waits them out on the
wall clock (scaled). Both take them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dse.catalog import ChipSpec

CREATE_S = (73.0, 108.0)        # Table 3: create a vPod instance (uniform in this range)
DELETE_S = 15.0                 # Table 3: delete a vPod instance
ENGINE_START_S = 31.0           # Table 3: NPU runtime and serving engine start-up
LOAD_BW_BYTES_PER_S = 24e9      # Table 3: load weights to the chips, per chip (PCIe 4.0 x16)
DCN_LATENCY_S = 1e-3            # per KV transfer between vPods (order of Fig. 13's small sizes)
STATS_QUERY_S = (2.0, 5.0)      # Table 3: query vPod runtime statistics (a plan acts this late)


@dataclass(frozen=True)
class Startup:
    """The stages between ordering a vPod and its engine serving (seconds)."""
    create_s: float           # the cloud creates the slice
    engine_start_s: float     # runtime and serving engine start
    download_s: float         # the weight shard over the chip's DCN link
    load_s: float             # the shard into HBM

    @property
    def total_s(self) -> float:
        return self.create_s + self.engine_start_s + self.download_s + self.load_s


def startup(chip: ChipSpec, shard_bytes: float, rng: np.random.Generator) -> Startup:
    """Draw one vPod's start-up: creation uniform in Table 3's range, then engine start, the
    download of its largest per-chip weight shard at the chip's DCN bandwidth and the load at
    24 GB/s per chip (chips load in parallel)."""
    return Startup(float(rng.uniform(*CREATE_S)), ENGINE_START_S,
                   shard_bytes / chip.dcn_bw_bytes_per_s, shard_bytes / LOAD_BW_BYTES_PER_S)


def kv_transfer_s(tokens: int, kv_bytes_per_token: float, dcn_bytes_per_s: float) -> float:
    """Moving ``tokens`` tokens of KV cache to another vPod over DCN."""
    return DCN_LATENCY_S + tokens * kv_bytes_per_token / dcn_bytes_per_s
