"""The observation window (paper §3.4): what both drivers of the policy have seen lately.

Every ``sample_s`` (10 s) a driver records, per phase, the token rate of each sequence bucket
(prefill: input tokens that arrived, decode: output tokens ordered) and notes the queues it sees
(requests waiting in engines or at the router, per group) and the time each finished request
spent on its vPod (per group, and per bucket its load was counted at); at each epoch
it asks for an :class:`~orchestrator.policy.Observation`: the last ``window_s`` of samples, the
peak queue per group since the previous epoch, the longest stay on a group's vPods and the mean
stay per bucket within the window, the inventory and the chips left under each quota. The cluster
simulator records virtual-time slices, the live controller wall-clock ones; the policy cannot
tell them apart.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Mapping

import numpy as np

from .policy import Observation, PolicyConfig, VPodRecord

PHASES = ("prefill", "decode")


class ObservationWindow:
    """A ring of the last ``window_s / sample_s`` rate samples per phase and bucket, plus the
    peak queue per group since the last epoch and the last sample's queues."""

    def __init__(self, num_buckets: int, config: PolicyConfig = PolicyConfig()):
        self.num_buckets = num_buckets
        self.size = int(round(config.window_s / config.sample_s))
        self.epoch_samples = int(round(config.epoch_s / config.sample_s))
        self._ring = {ph: np.zeros((self.size, num_buckets)) for ph in PHASES}
        self._filled = {ph: 0 for ph in PHASES}
        self.peak_queue: dict[str, dict[str, int]] = {ph: {} for ph in PHASES}
        # the last sample's queue per group: what an emergency between epochs is judged on
        # (the epoch's peak may be a queue that the vPods ordered for it have since served)
        self.queue_now: dict[str, dict[str, int]] = {ph: {} for ph in PHASES}
        # per epoch of the window (newest last): the longest time a request spent on a vPod
        # of each group, per phase (decode: from joining to its last token) - how long a
        # group's vPods take to drain
        n_epochs = max(1, int(round(config.window_s / config.epoch_s)))
        self._longest: dict[str, deque] = {ph: deque([{}], maxlen=n_epochs) for ph in PHASES}
        # per epoch of the window: bucket -> [seconds, requests] of the stays noted there
        self._stays: dict[str, deque] = {ph: deque([{}], maxlen=n_epochs) for ph in PHASES}

    def record(self, phase: str, token_rates: np.ndarray) -> None:
        """One sample: tokens/s per bucket over the last ``sample_s`` (its queues follow:
        :meth:`note_queue`)."""
        self.queue_now[phase] = {}
        k = self._filled[phase]
        self._ring[phase][k % self.size] = token_rates
        self._filled[phase] = k + 1

    def prime(self, phase: str, token_rates: np.ndarray, samples: int) -> None:
        """Start from ``samples`` identical samples (a warm start: a service already running
        at these rates)."""
        for _ in range(samples):
            self.record(phase, token_rates)

    def note_queue(self, phase: str, group: str, depth: int) -> None:
        """A group's aggregated queue in this sample (after :meth:`record`)."""
        pq = self.peak_queue[phase]
        if depth > pq.get(group, 0):
            pq[group] = depth
        now = self.queue_now[phase]
        if depth > now.get(group, 0):
            now[group] = depth

    def note_duration(self, phase: str, group: str, seconds: float) -> None:
        """A request left a vPod of ``group`` after ``seconds`` on it."""
        cur = self._longest[phase][-1]
        if seconds > cur.get(group, 0.0):
            cur[group] = seconds

    def note_stay(self, phase: str, bucket: int, seconds: float, requests: int = 1) -> None:
        """``requests`` requests whose load was counted at ``bucket`` held a vPod's server or
        slot for ``seconds`` in all (prefill: the prompt; decode: from joining a vPod to the
        last token)."""
        cur = self._stays[phase][-1]
        acc = cur.get(bucket)
        if acc is None:
            cur[bucket] = [seconds, requests]
        else:
            acc[0] += seconds
            acc[1] += requests

    def stays(self, phase: str) -> dict[int, float]:
        """Per bucket, the mean stay of the requests noted there within the window (s)."""
        tot: dict[int, list] = {}
        for d in self._stays[phase]:
            for b, (x, n) in d.items():
                acc = tot.setdefault(b, [0.0, 0])
                acc[0] += x
                acc[1] += n
        return {b: x / n for b, (x, n) in tot.items() if n > 0}

    def longest(self, phase: str) -> dict[str, float]:
        """Per group, the longest time a request spent on one of its vPods within the window."""
        out: dict[str, float] = {}
        for d in self._longest[phase]:
            for g, x in d.items():
                if x > out.get(g, 0.0):
                    out[g] = x
        return out

    def samples(self, phase: str) -> np.ndarray:
        """The window's samples, oldest first: shape (samples, buckets)."""
        k, r = self._filled[phase], self._ring[phase]
        return r[:k] if k < self.size else np.roll(r, -(k % self.size), axis=0)

    def observe(self, phase: str, now_s: float, inventory: list[VPodRecord],
                quotas: Mapping[str, int], used_chips: Mapping[str, int],
                epoch: bool = True) -> Observation:
        """The policy's input for ``phase``: per bucket with traffic its samples, the inventory,
        the queues - at an epoch (``epoch``) the peaks since the last :meth:`end_epoch`, for
        an emergency plan between epochs the last sample's - and the chips left under each
        quota (chip versions without a quota are unlimited)."""
        s = self.samples(phase)
        rates = {b: s[:, b] for b in range(s.shape[1]) if s[:, b].any()}
        queues = self.peak_queue[phase] if epoch else self.queue_now[phase]
        return Observation(now_s, rates, inventory, queues,
                           available_chips(quotas, used_chips), self.longest(phase),
                           self.stays(phase))

    def end_epoch(self) -> None:
        """The queues are peaks per epoch: start the next one."""
        self.peak_queue = {ph: {} for ph in PHASES}
        for d in (*self._longest.values(), *self._stays.values()):
            d.append({})


def available_chips(quotas: Mapping[str, int], used_chips: Mapping[str, int]) -> dict[str, int]:
    """Chips left per version under its quota (versions without a quota are absent)."""
    return {c: q - used_chips.get(c, 0) for c, q in quotas.items()}


def chips_in_use(vpods: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Chips held per version by ``(chip, num_chips)`` pairs (every vPod not released yet)."""
    used: dict[str, int] = {}
    for chip, n in vpods:
        used[chip] = used.get(chip, 0) + n
    return used
