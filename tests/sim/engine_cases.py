"""Step costs and workloads shared by the engine tests (a helper module, not collected)."""

from __future__ import annotations

import numpy as np

from dse import default_catalog, load_model
from dse.costmodel import Parallelism
from dse.vpod import ICITopology
from sim.chip import ChipModel
from sim.engine import AffineStepCost
from sim.stepcost import StepCostTable


def affine(kv_capacity_tokens: int = 4096) -> AffineStepCost:
    """Llama-8B-like magnitudes on 4 chips: ~8 ms weight reads per step, 128 KiB KV per token;
    memory-bound decode (latency affine in the summed KV: linearised decode runs are exact)."""
    return AffineStepCost(num_chips=4, static_power_w=50.0, kv_capacity_tokens=kv_capacity_tokens,
                          kv_bytes_per_token=131072.0, host_bw_bytes_per_s=16e9,
                          c0_s=2e-3, c_tok_s=2e-5, c_ctx_s=1e-9, c_seq_s=2e-5, m0_s=8e-3,
                          m_kv_s=5e-7, m_seq_s=1e-5, m_tok_s=1e-6, e_tok_j=0.05, e_ctx_j=1e-6,
                          e_seq_j=0.02, e_kv_j=1e-4)


def chip_table() -> StepCostTable:
    """The chip model's step-cost table: Llama3-8B on one v6e chip."""
    chip = default_catalog().get("v6e")
    return StepCostTable(ChipModel(load_model("llama3-8b"), chip, ICITopology.parse("1x1"),
                                   Parallelism(1)))


def workload(seed: int, n: int = 200, gap_s: float = 0.05, prompt=(16, 512),
             output=(1, 800)) -> list[tuple[int, float, int, int]]:
    """``n`` requests (id, arrival, prompt tokens, output tokens): Poisson arrivals ``gap_s``
    apart on average, uniform lengths."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(gap_s, n))
    p = rng.integers(*prompt, n)
    o = rng.integers(*output, n)
    return [(i, float(t[i]), int(p[i]), int(o[i])) for i in range(n)]
