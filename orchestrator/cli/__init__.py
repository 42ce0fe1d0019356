"""The ``orchestrator`` command line, one module per command group:

    orchestrator dse ...       offline best-fit vPod database and its checks   (cli/dse.py)
    orchestrator sim ...       the per-operator chip model, one step            (cli/sim.py)
    orchestrator simulate ...  trace replay through the autoscaling policies   (cli/simulate.py)
    orchestrator serve ...     the live stack: OpenAI gateway + controller      (cli/serve.py)
    orchestrator status        what a running `serve` is doing                  (cli/serve.py)
    orchestrator down          delete every vPod of a tpu/static cluster        (cli/serve.py)
    orchestrator logs VPOD     a tpu/static vPod's engine log                   (cli/serve.py)
    orchestrator predictor ... the output-length predictor: train, eval, predict (cli/predictor.py)

Every error a user can cause ends in one line ``error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from typing import Sequence

from dse.errors import NeuScaleError

from . import dse, predictor, serve, sim, simulate
from .common import Parser

GROUPS = (serve, dse, sim, simulate, predictor)


def build_parser() -> Parser:
    p = Parser(
        prog="orchestrator",
        description="NeuScale: serve LLMs on heterogeneous Cloud TPU pools (v4, v5e, v5p, v6e). "
                    "`dse` learns offline which vPod (chip x pod shape x parallelism x batch) "
                    "serves each sequence-length bucket best; `simulate` replays traces through "
                    "the autoscaler on simulated TPUs.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for group in GROUPS:
        group.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from backends.base import BackendError
    try:
        rc = args.func(args)
        sys.stdout.flush()          # here, where a closed pipe is handled (not at exit)
        return rc
    except (NeuScaleError, BackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`orchestrator sim step --ops | head`): not an error of ours;
        # point stdout at /dev/null so the interpreter's final flush does not raise again
        import os
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
