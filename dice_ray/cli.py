"""``dice-ray`` command line: train, sft, eval, curate, verify, scaffold, config, report, status, verifiers.

Exit status: 0 on success; 2 for unusable input (bad config, unreadable file), with a one-line error; 1 when a Ray
actor of ``train``, ``eval`` or ``curate`` failed (its traceback above, streamed by Ray; a one-line summary last).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

USAGE_ERROR = 2
RUN_FAILED = 1
TASKS_HELP = ("task set: 'builtin' (or 'builtin:N', its first N tasks), 'dice:PATH' (DICE JSON file or folder), "
              "'kernelbench:DIR', 'kernelbench-json:PATH', 'alpaca:PATH' (CuKe / Alpaca pairs) or 'jsonl:PATH'; "
              "several joined by '+' (DICE's two files: dice:INFILL.json+dice:E2E.json)")


def _fail(msg: str) -> int:
    print(f"dice-ray: error: {msg}", file=sys.stderr)
    return USAGE_ERROR


def _actor_errors() -> tuple[type[BaseException], ...]:
    """``(ray.exceptions.RayError,)`` once Ray is loaded (an actor of the command may have raised), else ``()``:
    evaluated in an ``except`` clause when an exception is matched, so a command that never used Ray never imports it."""
    mod = sys.modules.get("ray.exceptions")
    return (mod.RayError,) if mod is not None else ()


def _actor_failed(exc: BaseException) -> int:
    from dice_ray.cluster.errors import error_line

    print(f"dice-ray: error: {error_line(exc)}", file=sys.stderr)
    return RUN_FAILED


def _nearest_key(loc: tuple) -> str | None:
    """The config key nearest to the unknown key ``loc`` (``("rl", "num_generation")`` ->
    ``"rl.num_generations"``) among its section's keys (difflib's ratio >= 0.6), or None.  A key without a
    section is matched against every dotted key and every key's last part: ``steps`` -> ``"sft.steps or
    rl.steps"`` (config order), ``rl_steps`` -> ``"rl.steps"``."""
    from difflib import get_close_matches

    from dice_ray.config import load_config

    root: object = load_config(None, []).model_dump(mode="json")
    node = root
    for part in loc[:-1]:
        node = node.get(str(part)) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return None
    close = get_close_matches(str(loc[-1]), list(node), n=1)
    if close:
        return ".".join([*map(str, loc[:-1]), close[0]])
    if len(loc) != 1:
        return None
    name = str(loc[0])
    dotted = [f"{section}.{key}" for section, keys in root.items() if isinstance(keys, dict) for key in keys]
    leaves = [d.split(".", 1)[1] for d in dotted]
    same_leaf = [d for d, leaf in zip(dotted, leaves) if leaf == name]
    near_leaf = [d for d, leaf in zip(dotted, leaves) if leaf in get_close_matches(name, leaves, n=1)]
    found = same_leaf or get_close_matches(name.replace("_", ".", 1), dotted, n=1) or near_leaf
    return " or ".join(found[:3]) or None


def _config_error(exc, args: argparse.Namespace | None = None) -> str:
    """One line naming every bad key of a pydantic ValidationError and the rule each breaks (an unknown
    key with the nearest known one, when one is close); a key that no ``key=value`` override of ``args``
    set is said to come from its ``--config`` file, when it has one."""
    given = {o.split("=", 1)[0].strip() for o in getattr(args, "overrides", None) or ()}
    config = None if getattr(args, "resume", None) else getattr(args, "config", None)
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])  # empty: a rule across fields, whose message names them
        if err["type"] == "extra_forbidden":
            near = _nearest_key(tuple(err["loc"]))
            msg = "unknown key" + (f" (did you mean {near}?)" if near else "")
        else:
            msg = err["msg"].removeprefix("Value error, ")
        if config and loc and not any(loc == g or loc.startswith(g + ".") for g in given):
            msg += f" (in {config})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "config: " + "; ".join(parts)


def cmd_train(args: argparse.Namespace) -> int:
    """``train``: the RL job (:func:`dice_ray.cluster.trainer.train`) on a local Ray cluster, or on the one at
    ``--address`` / ``cluster.address`` (asked first: nothing answering there fails in seconds, exit 2).
    Returns the exit status: 0, 2 for unusable input or an unreachable cluster, 1 for an actor's failure,
    130 on Ctrl-C."""
    from pydantic import ValidationError

    from dice_ray.cluster.auth import ClusterUnreachable
    from dice_ray.cluster.trainer import train

    if args.address:
        args.overrides.append(f"cluster.address={args.address}")
    if args.tasks:
        args.overrides.append(f"tasks.spec={args.tasks}")
    try:
        if _plan_first(args):  # --dry-run: the plan printed, nothing started
            return 0
        train(args.config, args.overrides, args.resume)
    except KeyboardInterrupt as exc:  # the trainer printed the steps done and the --resume command
        from dice_ray.cluster.trainer import Terminated

        return 143 if isinstance(exc, Terminated) else 130  # 128 + the signal, as a shell reports it
    except _actor_errors() as exc:  # first: a RayTaskError(ValueError) is a ValueError
        return _actor_failed(exc)
    except ValidationError as exc:
        return _fail(_config_error(exc, args))
    except ClusterUnreachable as exc:  # --address / cluster.address: probed in seconds (auth.connect)
        return _fail(f"{exc}; start that cluster first (`ray start --head` prints its address), or leave --address "
                     "and cluster.address out to start a local one")
    except (FileNotFoundError, ValueError, ConnectionError) as exc:  # ConnectionError: e.g. auth.ClusterRefused
        return _fail(str(exc))
    return 0


def _plan_first(args: argparse.Namespace) -> bool:
    """``train``'s check before anything starts (:func:`dice_ray.cluster.plan.check`): the placement and per-GPU
    memory of each role against the GPUs (``--cluster-gpus`` / ``--gpus-per-node`` / ``--gpu-memory-gib``, else the
    cluster at the address, else this machine's). Returns True for ``--dry-run`` (the plan printed).

    Raises:
        PlanDoesNotFit (a ValueError): the plan cannot fit (exit 2), and what the config's loading raises.
    """
    from pathlib import Path

    from dice_ray.cluster.plan import check
    from dice_ray.config import load_config

    if args.resume:
        from dice_ray.cluster.trainer import resume_config

        cfg = resume_config(Path(args.resume).expanduser().resolve(), args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    check(cfg, dry_run=args.dry_run, cluster_gpus=args.cluster_gpus, gpus_per_node=args.gpus_per_node,
          gpu_memory_gib=args.gpu_memory_gib, prompt=args.prompt_tokens)
    return args.dry_run


def cmd_sft(args: argparse.Namespace) -> int:
    """``sft``: masked-diffusion SFT warm start on a task set's solutions; writes a policy to --out."""
    from pydantic import ValidationError

    from dice_ray.policy.sft import run_sft

    try:
        summary = run_sft(args.data, args.out, args.config, args.overrides, args.resume,
                          log=lambda s: print(f"dice-ray sft: {s}", file=sys.stderr, flush=True))
    except ValidationError as exc:
        return _fail(_config_error(exc, args))
    except (FileNotFoundError, ValueError) as exc:  # SFTInputError is a ValueError
        return _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    print(json.dumps(summary, indent=1))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config as YAML, or with ``--describe`` one line a key: value and meaning."""
    import yaml
    from pydantic import BaseModel, ValidationError

    from dice_ray.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ValidationError as exc:
        return _fail(_config_error(exc, args))
    except (FileNotFoundError, ValueError) as exc:
        bare = [o for o in args.overrides if "=" not in o]
        hint = (f" (--describe prints every key; to see one, filter it: dice-ray config --describe | grep {bare[0]})"
                if args.describe and bare else "")
        return _fail(str(exc) + hint)
    if not args.describe:
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0

    def describe(model: BaseModel, prefix: str) -> None:
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                describe(value, f"{prefix}{name}.")
            else:
                print(f"{prefix}{name} = {json.dumps(value, default=str)}" + (f"  # {field.description}" if field.description else ""))

    describe(cfg, "")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from dice_ray.config import load_config
    from dice_ray.verify.command import InputFileError, verify_files

    try:
        cfg = load_config(args.config, args.overrides)
        verdict = verify_files(args.task, args.candidate, cfg)
    except ValidationError as exc:
        return _fail(_config_error(exc, args))
    except InputFileError as exc:
        return _fail(str(exc))
    except (FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    if args.json:
        print(verdict.model_dump_json())
    else:
        speed = f"{verdict.speedup:.2f}x" if verdict.speedup is not None else "n/a"
        print(f"{verdict.verdict}: compiled={verdict.compiled} correct={verdict.correct} speedup={speed} "
              f"reward={verdict.reward:.3f} mode={verdict.mode}\n  {verdict.reason}")
    return 0


#: what to do when nothing answers at the address status / verifiers tried
_START_JOB = ("start the job first and pass its address: --address HOST:PORT (a local `dice-ray train` prints "
              "`ray HOST:PORT`; a cluster's head: HOST:6379)")

#: seconds of ray.init's own connection attempt, after the probe found the head (ray.init's default: ~10 minutes)
_RAY_CONNECT_S = 5.0


def _connect(address: str | None):
    """Connect to the cluster of ``--address``, else ``RAY_ADDRESS``, else the one Ray's ``"auto"`` finds on this
    machine (:func:`_latest_local_cluster`); ask its GCS first (a few seconds), so an address where nothing
    answers fails in seconds. Returns the ``ray`` module, connected.

    Raises:
        ConnectionError: a dashboard URL was given; no cluster was found on this machine; nothing answers as
            a Ray cluster at the address (the message names it, where it came from and what to do); the head
            refused the connection (token authentication: what to set); or ``ray.init`` failed.
    """
    import ray

    from dice_ray.cluster.auth import AUTH_HINT, ClusterRefused, ClusterUnreachable, connect
    from dice_ray.cluster.scheduler import NAMESPACE

    given, source = (address, "--address") if address else (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")
    if (given or "").startswith(("http://", "https://")):  # `ray job submit` takes this; ray.init does not
        raise ConnectionError(f"{source}={given} is a dashboard / job-submission URL; dice-ray status and verifiers "
                              "connect to the cluster itself: --address HOST:6379 (the head's GCS port)")
    if ray.is_initialized():  # called in-process by a driver that is already connected (tests)
        return ray
    found_here = not given
    if given:
        origin, why = f"from {source}", "no Ray cluster runs there now (not started yet, or already ended)"
    else:  # Ray's "auto": the latest cluster started on this machine, which may be gone
        given, origin, why = _latest_local_cluster()
    try:
        connect(given, attempt_timeout_s=_RAY_CONNECT_S, namespace=NAMESPACE, log_to_driver=False,
                logging_level="ERROR")
    except ClusterUnreachable as e:
        raise ConnectionError(f"no Ray cluster answers at {e.address} ({e.probe.detail}), the address {origin}: "
                              f"{why}; {_START_JOB}") from None
    except ClusterRefused as e:
        other = ("; it may be another user's or session's cluster on this machine: pass your job's --address"
                 if found_here else "")
        raise ConnectionError(f"the Ray cluster at {e.address} (the address {origin}) answered but refused the "
                              f"connection ({e.probe.detail}); {AUTH_HINT}{other}") from None
    return ray


def _latest_local_cluster() -> tuple[str, str, str]:
    """The GCS address Ray's ``"auto"`` means, found as Ray finds it: a Ray GCS process running on this machine,
    else the latest cluster record (``ray_current_cluster`` in Ray's temp dir, ``/tmp/ray`` or
    ``$RAY_TMPDIR/ray``, written by ``ray start``; with several GCS processes running, the record first).
    Returns ``(address, where it came from, what it means when nothing answers there)``; ``("auto", ...)``
    when this Ray cannot say (``ray.init`` resolves it).

    Raises:
        ConnectionError: no Ray cluster was started on this machine.
    """
    try:
        from ray._common.utils import get_ray_address_file
        from ray._private import services
        from ray._private.utils import read_ray_address
    except ImportError:  # another Ray: let ray.init resolve it
        return "auto", "of Ray's 'auto' (a cluster on this machine)", "that cluster is gone"
    record_file = get_ray_address_file(None)
    try:
        found = services.canonicalize_bootstrap_address("auto")
    except (ConnectionError, ValueError):  # Ray's own words say the same as ours
        found = None
    if not found:
        raise ConnectionError(f"no Ray cluster found on this machine (no GCS process, no {record_file}); {_START_JOB}")
    record = read_ray_address()
    try:
        from_record = bool(record) and services.canonicalize_bootstrap_address(record) == found
    except (ConnectionError, ValueError):
        from_record = False
    if from_record:
        return (found, f"from the latest local cluster record ({record_file}, written by `ray start`)",
                "a stale record of a cluster that is gone (ended without `ray stop`)")
    running = len(services.find_gcs_addresses())
    more = f", one of {running}" if running > 1 else ""
    return (found, f"of a Ray GCS process running on this machine (Ray's 'auto'{more})",
            "a hung or exiting process of a cluster that is gone")


def _named(ray, name: str):
    from dice_ray.cluster.scheduler import NAMESPACE

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise LookupError(f"no running dice-ray job on this cluster (named actor {name!r} not found)") from None


def cmd_status(args: argparse.Namespace) -> int:
    from dice_ray.cluster.scheduler import SCHEDULER_NAME
    from dice_ray.cluster.verifier_pool import POOL_NAME

    try:
        ray = _connect(args.address)
        sched, pool = _named(ray, SCHEDULER_NAME), _named(ray, POOL_NAME)
    except (LookupError, ConnectionError) as exc:
        return _fail(str(exc))
    status = ray.get(sched.status.remote())
    status["verifier_pool"] = ray.get(pool.status.remote())
    print(json.dumps(status, indent=1, default=str) if args.json else describe_status(status))
    return 0


def _num(x: Any, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def describe_status(status: dict) -> str:
    """The lines of ``dice-ray status``: the curriculum (phase, infill fraction, the next step the scheduler hands
    out: ahead of the last finished step while steps are in flight, each phase's task pool position), its newest
    decision with the figure behind it, the last finished step's rewards and times, and the verifier pool (size,
    queue, throughput in candidates/s)."""
    sched, last, pool = status.get("schedule", {}), status.get("last_step") or {}, status.get("verifier_pool", {})
    if status.get("restoring"):
        lines = ["resuming: the scheduler's state is not restored yet (the learner is loading the checkpoint)"]
    else:
        pools = "; ".join(f"{phase} epoch {p.get('epoch')}, position {p.get('position')}"
                          for phase, p in (sched.get("pools") or {}).items())
        holding = ", holding: the end-to-end reward collapsed" if (sched.get("curriculum") or {}).get("holding") else ""
        lines = [f"phase {sched.get('phase')} (infill fraction {_num(sched.get('infill_fraction'), '.2f')}{holding}); "
                 f"next step to sample {sched.get('step')} ({pools})"]
        decision = status.get("last_decision")
        lines.append(f"curriculum: step {decision['step']} {decision['action']}: {decision['reason']}" if decision
                     else "curriculum: no decision yet")
    if last:
        lines.append(
            f"last finished step {last.get('step')}: reward {_num(last.get('reward_mean'))} (std {_num(last.get('reward_std'))}), "
            f"compile {_num(last.get('compile_rate'), '.2f')}, correct {_num(last.get('correct_rate'), '.2f')}, cheat "
            f"{_num(last.get('cheat_rate'), '.2f')}, speedup {_num(last.get('speedup_geomean'), '.2f')}"
            f"{'' if last.get('speedup_geomean') is None else 'x'}, "
            f"{last.get('candidates')} candidates in {_num(last.get('step_seconds'), '.1f')} s")
    else:
        lines.append("no step finished yet")
    lines.append(describe_pool(pool))
    return "\n".join(lines)


def describe_pool(pool: dict) -> str:
    """One line of a :meth:`VerifierPool.status <dice_ray.cluster.verifier_pool.VerifierPool.status>`: size,
    serving and draining actors, queue depth, candidates in flight and verified, candidates/s, and the
    sandbox spares (ready of kept; replacements that found none ready) when the status has them."""
    line = (f"verifier pool: {pool.get('size')} actors ({pool.get('serving')} serving, {pool.get('draining')} draining), "
            f"queue {pool.get('queue_depth')}, in flight {pool.get('in_flight')}, {pool.get('completed')} verified, "
            f"{_num(pool.get('throughput_per_s'), '.2f')} candidates/s since it started")
    if pool.get("spares") is not None:
        line += f"; spare sandbox workers {_spares(pool)}"
    return line


def _spares(counts: dict) -> str:
    """``ready/kept ready, N replacements found none ready`` of a pool's or an actor's sandbox counters."""
    return (f"{counts.get('spares_ready')}/{counts.get('spares')} ready, "
            f"{counts.get('promoted')} replacements found none ready")


def describe_actors(pool: dict) -> str:
    """``verifiers status``: :func:`describe_pool`, then a line per verifier actor (index, state, node and
    GPU, in flight / capacity, verified, failures, restarts, utilization, its sandbox workers and spares
    when it answered, its reference facts prepared at start, error) and autoscaling if on."""
    lines = [describe_pool(pool)]
    for a in pool.get("actors") or []:
        where = f"{a.get('node') or '?'}" + (f" GPU {','.join(a['gpu'])}" if a.get("gpu") else " (no GPU)")
        line = (f"  actor {a.get('index')}: {a.get('state')} on {where}, in flight {a.get('in_flight')}/{a.get('capacity')}, "
                f"{a.get('done')} verified, {a.get('failures')} failures, {a.get('restarts')} restarts, "
                f"utilization {_num(a.get('utilization'), '.2f')}")
        box = a.get("sandbox")
        if box:
            line += f"; sandbox workers {box.get('workers')} ({box.get('restarts')} replaced), spares {_spares(box)}"
        prep = a.get("prepared")
        if prep:
            line += "; reference facts " + (
                prep.get("skipped") or (f"not prepared: {prep['error']}" if prep.get("error") else
                                        f"{prep.get('measured')} measured at start, {prep.get('known')} known, "
                                        f"{len(prep.get('failed') or {})} failed"))
        lines.append(line + (f"; error: {str(a['error']).splitlines()[0]}" if a.get("error") else ""))
    auto = pool.get("autoscale")
    if auto:
        lines.append(f"autoscaling between {auto.get('min')} and {auto.get('max')} actors by queue depth")
    return "\n".join(lines)


def cmd_verifiers(args: argparse.Namespace) -> int:
    """``verifiers scale N`` / ``verifiers status`` on the running job's pool; prints its status
    (:func:`describe_actors`; ``--json``: the whole status as JSON).

    ``scale`` returns at once: new actors start and surplus ones drain (their in-flight candidates
    finish) in the background; ``status`` shows the progress (``actors[].state``).
    """
    from dice_ray.cluster.verifier_pool import POOL_NAME

    if args.action == "scale" and (args.n is None or args.n < 1):
        got = "nothing" if args.n is None else args.n
        return _fail(f"verifiers scale N: N must be an integer >= 1, got {got}")
    if args.action == "status" and args.n is not None:
        return _fail("verifiers status takes no N")
    try:
        ray = _connect(args.address)
        pool = _named(ray, POOL_NAME)
    except (LookupError, ConnectionError) as exc:
        return _fail(str(exc))
    try:
        if args.action == "scale":
            status = ray.get(pool.scale.remote(args.n), timeout=120)
        else:
            status = ray.get(pool.status.remote(), timeout=120)
    except ray.exceptions.RayTaskError as exc:  # the pool refused (its ValueError)
        return _fail(f"verifiers {args.action}: {str(exc.cause) if exc.cause else exc}".splitlines()[0])
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
        return _fail(f"verifiers {args.action}: the verifier pool did not answer ({type(exc).__name__})")
    if args.action == "scale" and status.get("scaled_from") == args.n:
        print(f"dice-ray: the verifier pool's target is {args.n} actor{'' if args.n == 1 else 's'} already: nothing "
              "changed", file=sys.stderr)
    if args.action == "scale" and status.get("autoscale"):
        print(f"dice-ray: note: autoscaling is on; it resumes after {status['autoscale']['cooldown_s']:.0f} s "
              f"within [{status['autoscale']['min']}, {status['autoscale']['max']}]", file=sys.stderr)
    print(json.dumps(status, indent=1, default=str) if args.json else describe_actors(status))
    return 0


def cmd_scaffold(args: argparse.Namespace) -> int:
    """``scaffold FILE``: cut a solution into prefix / middle / suffix (the infilling phase's split)."""
    from dice_ray.tasks.scaffold import ScaffoldError, detect_format, make_scaffold
    from dice_ray.verify.command import InputFileError, read_source_file

    try:
        src = read_source_file(args.file)
        fmt = detect_format(src)
        sc = make_scaffold(src, fmt, args.granularity, args.kernel)
    except (InputFileError, ScaffoldError) as exc:
        return _fail(f"{args.file}: {exc}" if isinstance(exc, ScaffoldError) else str(exc))
    if args.json:
        print(json.dumps({"prefix": sc.prefix, "middle": sc.middle, "suffix": sc.suffix}))
    else:
        what = f"{args.granularity} granularity" + (f", kernel {args.kernel}" if args.kernel else "")
        for part in ("prefix", "middle", "suffix"):
            text = getattr(sc, part)
            print(f"----- {part} ({len(text)} chars; {fmt} format, {what}) -----")
            print(text, end="" if text.endswith("\n") else "\n")
    return 0


def _eval_config(args: argparse.Namespace):
    from dice_ray.config import load_config

    return load_config(args.config, args.overrides)


def cmd_eval(args: argparse.Namespace) -> int:
    """``eval``: verify a policy's samples or a solutions folder on a task set; write results.{json,md,png}."""
    from pydantic import ValidationError

    from dice_ray.eval.report import markdown
    from dice_ray.eval.run import EvalInputError, evaluate

    try:
        cfg = _eval_config(args)
        result = evaluate(args.tasks, cfg, args.out, model=args.model, solutions=args.solutions,
                          samples=args.samples, phase=args.phase, split=args.split, log=lambda s: print(f"dice-ray eval: {s}", file=sys.stderr))
    except _actor_errors() as exc:  # a GPU verifier pool's actor (first: a RayTaskError(ValueError) is a ValueError)
        return _actor_failed(exc)
    except ValidationError as exc:
        return _fail(_config_error(exc, args))
    except (EvalInputError, FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    print(markdown(result))
    return 0


def cmd_curate(args: argparse.Namespace) -> int:
    """``curate``: keep the tasks whose solution is correct and at least --min-speedup fast (JSONL)."""
    from pydantic import ValidationError

    from dice_ray.eval.curate import NoGpuVerifier, curate
    from dice_ray.eval.run import EvalInputError

    try:
        cfg = _eval_config(args)
        summary = curate(args.tasks, cfg, args.min_speedup, args.out, args.allow_compile_only,
                         log=lambda s: print(f"dice-ray curate: {s}", file=sys.stderr))
    except _actor_errors() as exc:
        return _actor_failed(exc)
    except ValidationError as exc:
        return _fail(_config_error(exc, args))
    except (NoGpuVerifier, EvalInputError, FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    print(json.dumps(summary, indent=1))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``report RUN_DIR``: curves.png and report.md of a run (finished or still going); prints the Markdown."""
    from dice_ray.report import NotARunDir, write_report

    try:
        png, md, text = write_report(args.run_dir, args.out)
    except NotARunDir as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"report: cannot write to {args.out or args.run_dir} ({exc.strerror or exc})")
    print(text, end="")
    print(f"dice-ray report: wrote {md} and {png}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dice-ray", description="DICE bi-phase RL of diffusion LLMs writing CUDA kernels, on Ray")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run the RL job (embedded default without arguments)")
    t.add_argument("--config", help="YAML config (see configs/; every section applies)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else a new private local cluster; `auto`: the "
                   "cluster `ray start` runs on this machine)")
    t.add_argument("--tasks", help=TASKS_HELP + " (default: the config's tasks.spec, builtin:24)")
    t.add_argument("--dry-run", action="store_true", help="print the placement of each role (GPUs, nodes) and its "
                   "per-GPU memory estimate, check that it fits, and start nothing (exit 0: fits or capacity unknown; "
                   "2: does not fit). Without it the same check runs first and refuses a plan that cannot fit")
    t.add_argument("--cluster-gpus", type=int, metavar="N", help="check against a cluster of N GPUs (default: the "
                   "cluster at --address / RAY_ADDRESS, else this machine's GPUs)")
    t.add_argument("--gpus-per-node", type=int, metavar="N", help="with --cluster-gpus: GPUs a node (default: one node)")
    t.add_argument("--gpu-memory-gib", type=float, metavar="GIB", help="memory of one GPU (default: this machine's "
                   "GPU, else the cluster's GPU type)")
    t.add_argument("--prompt-tokens", type=int, metavar="N", help="prompt length the memory estimate assumes "
                   "(default: 512 for tasks.prompt_template=compact, 2048 for dice)")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. rl.steps=10")
    t.set_defaults(fn=cmd_train)

    ft = sub.add_parser("sft", help="masked-diffusion SFT warm start on a task set's solutions (the policy RL starts from)")
    ft.add_argument("--data", help=TASKS_HELP + "; default: the config's tasks.spec (builtin), or the resumed run's")
    ft.add_argument("--out", required=True, metavar="DIR",
                    help="folder for the policy, sft_metrics.jsonl and checkpoints/ (then: dice-ray train model.path=DIR)")
    ft.add_argument("--config", help="YAML config (its model, sft, tasks sections and rl.seed apply)")
    ft.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    ft.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. sft.steps=200")
    ft.set_defaults(fn=cmd_sft)

    v = sub.add_parser("verify", help="one verdict for one candidate")
    v.add_argument("--task", required=True, help="KernelBench-format reference .py (Model, get_inputs, get_init_inputs)")
    v.add_argument("--candidate", required=True, help="candidate solution .py (fast or load_inline format)")
    v.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    v.add_argument("--config", help="YAML config (its verify and reward sections apply)")
    v.add_argument("overrides", nargs="*", metavar="key=value")
    v.set_defaults(fn=cmd_verify)

    c = sub.add_parser("config", help="print the resolved config (YAML), or every key with its meaning (--describe)")
    c.add_argument("--config", help="YAML config (see configs/)")
    c.add_argument("--describe", action="store_true", help="one line a key: dotted name = value  # meaning")
    c.add_argument("overrides", nargs="*", metavar="key=value")
    c.set_defaults(fn=cmd_config)

    s = sub.add_parser("status", help="phase, step, pool and last rewards of a running job")
    s.add_argument("--address", help="Ray address (default: RAY_ADDRESS or auto)")
    s.add_argument("--json", action="store_true", help="everything as JSON (the schedule, the last step's metrics, "
                   "the pool's counters per actor) instead of three lines")
    s.set_defaults(fn=cmd_status)

    vs = sub.add_parser("verifiers", help="scale or inspect the verifier pool of a running job")
    vs.add_argument("action", choices=["scale", "status"])
    vs.add_argument("n", nargs="?", type=int, help="new pool size (scale; an integer >= 1)")
    vs.add_argument("--address", help="Ray address (default: RAY_ADDRESS or auto)")
    vs.add_argument("--json", action="store_true", help="the pool's whole status as JSON instead of a line an actor")
    vs.set_defaults(fn=cmd_verifiers)

    sc = sub.add_parser("scaffold", help="cut a solution file into prefix / middle / suffix (infilling)")
    sc.add_argument("file", help="solution .py (fast or load_inline format, detected from its loader call)")
    sc.add_argument("--granularity", choices=["source", "body"], default="source",
                    help="source: the whole CUDA source (DICE's split); body: one __global__ kernel's body")
    sc.add_argument("--kernel", metavar="NAME", help="with --granularity body: the kernel to cut (default the first)")
    sc.add_argument("--json", action="store_true", help='print {"prefix", "middle", "suffix"} as one JSON object')
    sc.set_defaults(fn=cmd_scaffold)
    ev = sub.add_parser("eval", help="KernelBench metrics of a policy or a solutions folder on a task set")
    ev.add_argument("--tasks", required=True, help=TASKS_HELP)
    src = ev.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PATH", help="policy to sample from: a `dice-ray train` run directory (its newest checkpoint), a saved policy "
                     "folder (DiffusionPolicy.save, `dice-ray sft --out`), or an SDAR/LLaDA/Dream checkpoint folder or hub id")
    src.add_argument("--solutions", metavar="DIR",
                     help="solution files: DIR/<task id, '/' -> '__'>.py or DIR/<task name>.py (or a folder of .py samples)")
    ev.add_argument("--samples", type=int, default=1,
                    help="with --model: completions a task (pass@k uses them all; default 1)")
    ev.add_argument("--phase", choices=["e2e", "infill"], default="e2e",
                    help="with --model: which prompt to pose (default e2e: the whole solution)")
    ev.add_argument("--split", choices=["all", "heldout", "train"], default="all",
                    help="which tasks of --tasks: all (default), or the held-out / training part of the split "
                         "`dice-ray train` made (a --model run directory's own, else a default run's); "
                         "tasks.max_tasks then takes the first N of it")
    ev.add_argument("--out", default="eval_out", help="folder for results.json, results.md, results.png (default eval_out)")
    ev.add_argument("--config", help="YAML config (tasks, sampling, verify, reward, cluster sections apply)")
    ev.add_argument("overrides", nargs="*", metavar="key=value")
    ev.set_defaults(fn=cmd_eval)

    cu = sub.add_parser("curate", help="keep tasks whose solution is correct and fast enough (needs a GPU verifier)")
    cu.add_argument("--tasks", required=True, help=TASKS_HELP)
    cu.add_argument("--min-speedup", type=float, default=2.0, help="keep solutions at least this many times faster than eager")
    cu.add_argument("--out", required=True, help="JSONL file of the accepted tasks")
    cu.add_argument("--allow-compile-only", action="store_true",
                    help="without a GPU: write compile-checked tasks with speedup null instead of failing")
    cu.add_argument("--config", help="YAML config (tasks, verify, reward, cluster sections apply)")
    cu.add_argument("overrides", nargs="*", metavar="key=value")
    cu.set_defaults(fn=cmd_curate)

    rp = sub.add_parser("report", help="curves.png and report.md of a run directory (also of a run still going)")
    rp.add_argument("run_dir", metavar="RUN_DIR", help="a dice-ray train run directory (config.yaml, metrics.jsonl)")
    rp.add_argument("--out", metavar="DIR", help="folder for curves.png and report.md (default: RUN_DIR)")
    rp.set_defaults(fn=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dice-ray`` console script.  Output piped into a reader that stops early
    (``dice-ray config --describe | head``) ends the command quietly, as other command-line tools do."""
    args = build_parser().parse_args(argv)
    try:
        rc = args.fn(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is an "Exception ignored" message
        return rc
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 141  # 128 + SIGPIPE, what a shell reports for such a pipe


if __name__ == "__main__":
    sys.exit(main())
