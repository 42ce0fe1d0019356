"""The baselines of the paper's evaluation (§5.1, §5.5), on the policy's own sizing rules.

* :class:`HomogeneousPolicy` - the paper's "Base": one homogeneous group, the best fit of the
  longest sequence the workload has, scaled in count only.
* :class:`MultiPoolPolicy` - DynamoLLM-like: K fixed pools over equal percentiles of the
  workload's lengths.

Both only change how buckets are assigned to groups (:meth:`Policy._bucket_groups`); sizing,
emergency scale-out, quotas and eviction are the policy's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from dse.db import BestFitDB
from dse.errors import NeuScaleError

from .policy import GroupSpec, Policy, PolicyConfig


class HomogeneousPolicy(Policy):
    """The baseline of §5.1: one homogeneous group, the best fit of the longest sequence the
    workload has, scaled in count only (same sizing rules, no coalescing or fail-over)."""

    def __init__(self, db: BestFitDB, phase: str, longest_len: int,
                 config: PolicyConfig = PolicyConfig()):
        super().__init__(db, phase, replace(config, coalescing=False, failover=False))
        i = db.bucket_index(min(int(longest_len), db.edges[-1]))
        while i < len(db.edges) - 1 and self._entry(i) is None:
            i += 1
        e = self._entry(i)
        if e is None:
            raise NeuScaleError(f"no {phase} best fit for the longest sequence ({longest_len})")
        self.spec = GroupSpec.of(e)

    def _bucket_groups(self, buckets, actions):
        return {i: self.spec.id for i in buckets}, {self.spec.id: self.spec}


class MultiPoolPolicy(Policy):
    """The DynamoLLM-like baseline of §5.5: ``K`` fixed pools over equal percentiles of the
    workload's sequence lengths, each the best fit of its longest bucket, scaled in count only
    (no coalescing or fail-over)."""

    def __init__(self, db: BestFitDB, phase: str, lengths, pools: int,
                 config: PolicyConfig = PolicyConfig()):
        super().__init__(db, phase, replace(config, coalescing=False, failover=False))
        if pools < 1:
            raise NeuScaleError(f"multipool needs K >= 1 pools (got {pools})")
        lens = np.minimum(np.asarray(lengths, dtype=np.int64), db.edges[-1])
        if lens.size == 0:
            raise NeuScaleError("multipool needs the workload's lengths")
        cuts = np.quantile(lens, np.linspace(0, 1, pools + 1)[1:])
        self.pool_of: dict[int, GroupSpec] = {}
        lo = 0
        for k, cut in enumerate(cuts):
            hi = db.bucket_index(int(math.ceil(cut)))
            j = hi
            while j < len(db.edges) - 1 and self._entry(j) is None:
                j += 1
            e = self._entry(j)
            if e is None:
                raise NeuScaleError(f"no {phase} best fit for pool {k + 1} (<= {int(cut)})")
            spec = GroupSpec.of(e, prefix=f"pool{k + 1}:")
            for i in range(lo, hi + 1):
                self.pool_of.setdefault(i, spec)
            lo = hi + 1
        last = self.pool_of[max(self.pool_of)]
        for i in range(len(db.edges)):
            self.pool_of.setdefault(i, last)

    def _bucket_groups(self, buckets, actions):
        b2g = {i: self.pool_of[i].id for i in buckets}
        return b2g, {self.pool_of[i].id: self.pool_of[i] for i in buckets}
