"""Operations on a real cluster besides serving it: ``serve --dry-run`` (what a start would
create and run, without calling any API), ``down`` (delete every vPod labelled with the
cluster's name, and nothing else) and ``logs`` (an engine's log, over SSH)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from dse.errors import NeuScaleError

from .service import ServeConfig, Service, default_state_path, remote_backend


def dry_run(cfg: ServeConfig) -> dict[str, Any]:
    """Validate the config and describe the vPods a start creates first (the controller's
    bootstrap plan) with the slice each becomes and the exact commands run on its hosts."""
    from backends.base import BackendError
    from backends.config import parse_sections
    from backends.engine import display, engine_env, host_plan

    from .controller import first_plans, vpod_spec
    from .registry import PHASES
    if cfg.backend not in ("tpu", "static"):
        raise NeuScaleError("--dry-run is for --backend tpu or static")
    svc = Service(cfg)
    svc.load()
    warnings: list[str] = []
    try:
        p = parse_sections(cfg.backend, cfg.sections(), svc.catalog, svc.arch.name,
                           check_files=False)
    except BackendError as e:
        raise NeuScaleError(str(e)) from None
    engine, ssh, tpu = p.engine, p.ssh, p.tpu
    for path, what in ((ssh.key_path, "ssh.key_path"), (ssh.known_hosts, "ssh.known_hosts")):
        if path and not Path(path).is_file():
            warnings.append(f"{what}: {path} does not exist on this machine")
    for var, what in ((engine.api_key_env, "engine.api_key_env"),
                      (cfg.api_key_env, "api_key_env")):
        if var and not os.environ.get(var):
            warnings.append(f"{what}: ${var} is not set here")
    ccfg, policies = svc.control(svc.max_context())
    plans = first_plans(svc.db, policies, ccfg)
    vpods = []
    free = list(p.hosts)
    n = 0
    for ph in PHASES:
        plan = plans[ph]
        for a in plan.actions:
            if str(a.kind) != "create":
                continue
            e = plan.groups[a.group].entry
            n += 1
            vid = f"{cfg.cluster}-{ph[0]}{n:04d}-xxxx"
            spec = vpod_spec(ccfg, vid, a.group, ph, e.chip, e.topology, e.num_chips, e.tp,
                             e.pp, e.ep, e.max_batch, ccfg.max_model_len, attn=e.attn)
            chip = svc.catalog.get(e.chip)
            item: dict[str, Any] = {
                "id": vid, "phase": ph, "group": a.group, "chip": e.chip,
                "topology": e.topology, "num_chips": e.num_chips, "tp": e.tp, "pp": e.pp,
                "ep": e.ep, "attn": e.attn, "max_batch": e.max_batch,
                "max_model_len": ccfg.max_model_len,
                "reason": a.reason, "labels": dict(spec.labels)}
            port = None
            if tpu is not None:
                from backends.tpu import slice_for
                sl = slice_for(chip.name, e.topology, e.num_chips, chip.chips_per_host)
                zones = tpu.zones.get(chip.name)
                if not zones:
                    raise NeuScaleError(f"tpu.zones has no zone for {chip.name}, which the "
                                        f"plan uses for {ph}: add one, or leave {chip.name} "
                                        "out of the quotas")
                workers = [f"<{vid}-worker{i}>" for i in range(sl.hosts)]
                item.update({
                    "zone": zones[0], "accelerator_type": sl.type_name,
                    "accelerator_topology": sl.topology, "slice_chips": sl.num_chips,
                    "workers": sl.hosts, "runtime_version": tpu.runtime_version(chip.name),
                    "provisioning": tpu.provisioning, "spot": tpu.spot,
                    "usd_per_hour": round(chip.price_usd_per_chip_hour * sl.num_chips, 4)})
                if sl.num_chips > e.num_chips:
                    warnings.append(f"{vid}: the {e.num_chips}-chip vPod runs on the smallest "
                                    f"{chip.name} slice, {sl.topology} ({sl.num_chips} chips, "
                                    "all paid for)")
            else:
                h = next((x for x in free if x.chip == e.chip and x.num_chips >= e.num_chips),
                         None)
                if h is None:
                    warnings.append(f"{vid}: no free static {e.chip} host with >= "
                                    f"{e.num_chips} chips: the controller fails over")
                    vpods.append(item)
                    continue
                free.remove(h)
                workers, port = list(h.workers), h.engine_port
                item.update({"host": h.name, "workers": len(workers)})
            s = engine if port is None else _with_port(engine, port)
            s = _at_home(s, ssh.user)
            env = engine_env(spec, s, item.get("slice_chips"))
            item["commands"] = [{"host": w, "process": name, "command": display(argv, env if
                                 name == vid else {})} for w, name, argv in
                                host_plan(spec, workers, s)]
            item["engine_env_secrets"] = sorted(
                k for k, v in (("VLLM_API_KEY", engine.api_key_env),
                               ("HF_TOKEN", engine.hf_token_env)) if v)
            vpods.append(item)
    return {"backend": cfg.backend, "cluster": cfg.cluster, "model": svc.arch.name,
            "engine_model": engine.model, "metric": cfg.metric, "vpods": vpods,
            "warnings": warnings,
            "note": "nothing was created: this is what `serve` starts with, before any "
                    "request; the autoscaler then follows the load"}


def _at_home(engine, user: str):
    """``~`` as the hosts resolve it (the login's home; shown, not guessed, at run time)."""
    from dataclasses import replace
    home = f"/home/{user}"
    wd = home + engine.workdir[1:] if engine.workdir.startswith("~") else engine.workdir
    m = home + engine.model[1:] if engine.model.startswith("~/") else engine.model
    return replace(engine, workdir=wd, model=m)


def _with_port(engine, port: int):
    from dataclasses import replace
    return replace(engine, port=port)


def format_dry_run(d: dict[str, Any]) -> str:
    lines = [f"dry run: backend {d['backend']}, cluster {d['cluster']}, model {d['model']} "
             f"(weights {d['engine_model']}), metric {d['metric']}"]
    for v in d["vpods"]:
        where = (f"{v['zone']}: {v['accelerator_type']} {v['accelerator_topology']} "
                 f"({v['slice_chips']} chips, {v['workers']} host(s), {v['runtime_version']}, "
                 f"{v['provisioning']}{', spot' if v.get('spot') else ''}, "
                 f"${v['usd_per_hour']:.2f}/h)") if "zone" in v else \
            (f"host {v['host']}" if "host" in v else "no host")
        lines.append(f"\nvPod {v['id']} ({v['phase']}, group {v['group']}): {v['chip']}:"
                     f"{v['topology']} tp={v['tp']} pp={v['pp']} ep={v['ep']} "
                     + ("(attention TP over tp*ep) " if v.get("attn") == "tp" else "") + "batch "
                     f"{v['max_batch']} -> {where}")
        lines.append(f"  why: {v['reason']}")
        for c in v.get("commands", []):
            lines.append(f"  on {c['host']} ({c['process']}):\n    {c['command']}")
        if v.get("engine_env_secrets"):
            lines.append(f"  secrets in the engine's 0600 env file, not on the command line: "
                         f"{', '.join(v['engine_env_secrets'])}")
    for w in d["warnings"]:
        lines.append(f"warning: {w}")
    lines.append(d["note"])
    return "\n".join(lines)


def _backend(cfg: ServeConfig):
    """The config's tpu/static backend, without building the model's DB."""
    from dse.catalog import default_catalog
    from dse.models import load_model
    return remote_backend(cfg, default_catalog(list(cfg.chip_files)), load_model(cfg.model).name)


async def down(cfg: ServeConfig, progress=print) -> list[str]:
    """Delete every vPod labelled ``neuscale-cluster=<cluster>`` (and nothing else), and what
    the backend still has pending for it (queued resources); the state file's rows are marked
    released. The ids deleted."""
    from backends.base import BackendError
    backend = _backend(cfg)
    labels = {"neuscale-cluster": cfg.cluster}
    deleted: list[str] = []
    try:
        try:
            infos = await backend.list(labels)
        except BackendError as e:
            raise NeuScaleError(f"listing the cluster's vPods: {e}") from None
        progress(f"{len(infos)} vPod(s) labelled neuscale-cluster={cfg.cluster}")

        async def one(vid: str) -> None:
            try:
                await backend.delete(vid)
            except BackendError as e:
                progress(f"  {vid}: NOT deleted: {e}")
                return
            deleted.append(vid)
            progress(f"  {vid}: deleted")
        await asyncio.gather(*(one(i.spec.id) for i in infos))
        for name in await backend.delete_pending(labels):
            progress(f"  pending {name}: deleted")
    finally:
        await backend.close()
    _mark_released(cfg, deleted)
    return deleted


def _mark_released(cfg: ServeConfig, ids: list[str]) -> None:
    path = Path(cfg.state) if cfg.state else default_state_path(cfg.cluster)
    if not path.exists() or not ids:
        return
    from dse.vpod import VPodState

    from .state import StateStore
    st = StateStore(path)
    try:
        for vid in ids:
            st.update_vpod(vid, state=VPodState.RELEASED, released_at=time.time(),
                           reason="orchestrator down")
    finally:
        st.close()


async def logs(cfg: ServeConfig, vpod_id: str, lines: int = 200) -> str:
    from backends.base import BackendError
    backend = _backend(cfg)
    try:
        return await backend.logs(vpod_id, lines=lines)
    except BackendError as e:
        raise NeuScaleError(str(e)) from None
    finally:
        await backend.close()
