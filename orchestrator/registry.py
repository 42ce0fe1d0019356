"""The one list of autoscaling policies: names, parsing and construction.

Names: ``neuscale`` (the §3.4 policy with the allocation of every group chosen at its load,
:mod:`orchestrator.loadaware`), ``neuscale-paper`` (the §3.4 policy as the paper states it: best
fits at full batch), ``base`` (the paper's homogeneous baseline, §5.1), ``multipool:K`` (K fixed
percentile pools, DynamoLLM-like, §5.5), and two oracles that are priced, not run: ``ideal``
(§5.1: every request at its best fit's full batch) and ``ideal-at-load`` (every request at the
allocation cheapest for its bucket at the load of its epoch, no provisioning delay;
:mod:`orchestrator.cluster.accounting`). The CLI validates ``--policy`` against
:func:`parse_policy_names`; both drivers build policies with :func:`make_policies`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from dse.db import BestFitDB
from dse.errors import NeuScaleError

from dse.catalog import Catalog

from .baselines import HomogeneousPolicy, MultiPoolPolicy
from .loadaware import LoadAwarePolicy
from .policy import Policy, PolicyConfig
from .pricing import ChipModelPricer, Pricer

PHASES = ("prefill", "decode")
POLICY_NAMES = ("neuscale", "neuscale-paper", "base", "ideal", "ideal-at-load", "multipool:K")
ORACLES = ("ideal", "ideal-at-load")        # priced, not run
ORACLE = "ideal"


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


#: the policies that can run live (the others need the whole trace's lengths up front)
LIVE_POLICIES = ("neuscale", "neuscale-paper")


def make_live_policies(name: str, db: BestFitDB, config: PolicyConfig,
                       catalog: Catalog | None = None, pricer: Pricer | None = None
                       ) -> dict[str, Policy]:
    """One autoscaler per phase for ``orchestrator serve``: ``neuscale`` (load-aware, pricing
    with ``pricer``: the live one is calibrated) or ``neuscale-paper`` (the paper's rule)."""
    if name not in LIVE_POLICIES:
        raise NeuScaleError(f"policy {name!r} cannot serve live (it is sized from a whole "
                            f"trace or prices requests after the fact); use one of "
                            f"{', '.join(LIVE_POLICIES)}")
    return make_policies(name, db, config, np.ones(1, np.int64), np.ones(1, np.int64),
                         None, catalog, pricer)


def check_policy_name(name: str) -> str:
    if name in ("neuscale", "neuscale-paper", "base", *ORACLES) or _pools(name) is not None:
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
                  phase_chips: Mapping[str, Sequence[str] | None] | None = None,
                  catalog: Catalog | None = None, pricer: Pricer | None = None
                  ) -> dict[str, Policy]:
    """One autoscaler per phase for policy ``name`` (not an oracle); ``phase_chips`` restricts
    each phase's autoscaler to some chip versions (§5.4's chip mixes). The load-aware policy
    prices allocations with ``pricer`` (default: the chip model of the DB's model on
    ``catalog``)."""
    check_policy_name(name)
    if name in ORACLES:
        raise NeuScaleError(f"{name!r} is an oracle that prices requests, not a policy that "
                            "runs")
    if name == "neuscale" and pricer is None:
        from dse.catalog import default_catalog
        from dse.models import ModelArch
        pricer = ChipModelPricer(ModelArch(**db.meta["model_arch"]),
                                 catalog or default_catalog(), db.stack)
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
        elif name == "neuscale":
            out[ph] = LoadAwarePolicy(db, ph, cfg, pricer=pricer)
        else:
            out[ph] = Policy(db, ph, cfg)
    return out
