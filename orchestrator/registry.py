"""The one list of autoscaling policies: names, parsing and construction.

Names: ``neuscale`` (the §3.4 policy), ``base`` (the paper's homogeneous baseline, §5.1),
``multipool:K`` (K fixed percentile pools, DynamoLLM-like, §5.5) and ``ideal`` (the §5.1 oracle:
not a policy that runs, it prices every request at its best fit; the simulator reports it
through :func:`orchestrator.cluster.ideal_report`). The CLI validates ``--policy`` against
:func:`parse_policy_names`; both drivers build policies with :func:`make_policies`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from dse.db import BestFitDB
from dse.errors import NeuScaleError

from .baselines import HomogeneousPolicy, MultiPoolPolicy
from .policy import Policy, PolicyConfig

PHASES = ("prefill", "decode")
POLICY_NAMES = ("neuscale", "base", "ideal", "multipool:K")
ORACLE = "ideal"                  # priced, not run


def _pools(name: str) -> int | None:
    """K of ``multipool:K`` (None for any other name)."""
    if not name.startswith("multipool:"):
        return None
    text = name.split(":", 1)[1]
    try:
        k = int(text)
    except ValueError:
        raise NeuScaleError(f"policy {name!r}: expected multipool:K with an integer K") from None
    if k < 1:
        raise NeuScaleError(f"policy {name!r}: multipool needs K >= 1 pools")
    return k


def check_policy_name(name: str) -> str:
    if name in ("neuscale", "base", ORACLE) or _pools(name) is not None:
        return name
    raise NeuScaleError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")


def parse_policy_names(text: str) -> list[str]:
    """``neuscale,base,multipool:4`` -> the names, each checked; at least one, no repeats."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise NeuScaleError(f"--policy {text!r} names no policy; known: {', '.join(POLICY_NAMES)}")
    seen: set[str] = set()
    for n in names:
        check_policy_name(n)
        if n in seen:
            raise NeuScaleError(f"--policy {text!r} names {n!r} twice")
        seen.add(n)
    return names


def make_policies(name: str, db: BestFitDB, config: PolicyConfig, input_tokens, output_tokens,
                  phase_chips: Mapping[str, Sequence[str] | None] | None = None
                  ) -> dict[str, Policy]:
    """One autoscaler per phase for policy ``name`` (not the oracle); ``phase_chips`` restricts
    each phase's autoscaler to some chip versions (§5.4's chip mixes)."""
    check_policy_name(name)
    if name == ORACLE:
        raise NeuScaleError("'ideal' is an oracle that prices requests, not a policy that runs")
    inp = np.asarray(input_tokens)
    tot = inp + np.asarray(output_tokens)
    lengths = {"prefill": inp, "decode": tot}
    out: dict[str, Policy] = {}
    for ph in PHASES:
        cfg = config
        if phase_chips and phase_chips.get(ph):
            cfg = replace(config, chips=tuple(phase_chips[ph]))
        k = _pools(name)
        if k is not None:
            out[ph] = MultiPoolPolicy(db, ph, lengths[ph], k, cfg)
        elif name == "base":
            out[ph] = HomogeneousPolicy(db, ph, int(lengths[ph].max()), cfg)
        else:
            out[ph] = Policy(db, ph, cfg)
    return out
