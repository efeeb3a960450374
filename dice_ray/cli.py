"""``dice-ray`` command line: train, verify, status, verifiers.

Exit status: 0 on success; 2 for unusable input (bad config, unreadable file), with a one-line error.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

USAGE_ERROR = 2


def _fail(msg: str) -> int:
    print(f"dice-ray: error: {msg}", file=sys.stderr)
    return USAGE_ERROR


def _config_error(exc) -> str:
    """One line naming the first bad key of a pydantic ValidationError and the rule it breaks."""
    first = exc.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    return f"config: {loc}: {msg}"


def cmd_train(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from dice_ray.cluster.trainer import train

    if args.address:
        args.overrides.append(f"cluster.address={args.address}")
    if args.tasks:
        args.overrides.append(f"tasks.spec={args.tasks}")
    try:
        train(args.config, args.overrides, args.resume)
    except ValidationError as exc:
        return _fail(_config_error(exc))
    except (FileNotFoundError, ValueError) as exc:
        return _fail(str(exc))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from dice_ray.config import load_config
    from dice_ray.verify.command import InputFileError, verify_files

    try:
        cfg = load_config(args.config, args.overrides)
        verdict = verify_files(args.task, args.candidate, cfg)
    except ValidationError as exc:
        return _fail(_config_error(exc))
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


def _connect(address: str | None):
    import ray

    from dice_ray.cluster.scheduler import NAMESPACE

    if ray.is_initialized():  # called in-process by a driver that is already connected (tests)
        return ray
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    host, sep, port = address.rpartition(":")
    if sep and "://" not in address and port.isdigit():  # HOST:PORT of a GCS: ray.init would retry for minutes
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
        except OSError as e:
            raise ConnectionError(f"no Ray cluster answers at {address} ({e.strerror or e}); "
                                  "start one (ray start --head) or pass the head's --address HOST:6379") from None
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    return ray


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
    print(json.dumps(status, indent=1, default=str))
    return 0


def cmd_verifiers(args: argparse.Namespace) -> int:
    """``verifiers scale N`` / ``verifiers status`` on the running job's pool; prints its status as JSON.

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
    if args.action == "scale" and status.get("autoscale"):
        print(f"dice-ray: note: autoscaling is on; it resumes after {status['autoscale']['cooldown_s']:.0f} s "
              f"within [{status['autoscale']['min']}, {status['autoscale']['max']}]", file=sys.stderr)
    print(json.dumps(status, indent=1, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dice-ray", description="DICE bi-phase RL of diffusion LLMs writing CUDA kernels, on Ray")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run the RL job (embedded default without arguments)")
    t.add_argument("--config", help="YAML config (see configs/)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else a new local cluster)")
    t.add_argument("--tasks", help="task set: 'builtin' (default) or 'dice:PATH' (DICE JSON file or folder)")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. rl.steps=10")
    t.set_defaults(fn=cmd_train)

    v = sub.add_parser("verify", help="one verdict for one candidate")
    v.add_argument("--task", required=True, help="KernelBench-format reference .py (Model, get_inputs, get_init_inputs)")
    v.add_argument("--candidate", required=True, help="candidate solution .py (fast or load_inline format)")
    v.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    v.add_argument("--config", help="YAML config (its verify and reward sections apply)")
    v.add_argument("overrides", nargs="*", metavar="key=value")
    v.set_defaults(fn=cmd_verify)

    s = sub.add_parser("status", help="phase, step, pool and last rewards of a running job")
    s.add_argument("--address", help="Ray address (default: RAY_ADDRESS or auto)")
    s.set_defaults(fn=cmd_status)

    vs = sub.add_parser("verifiers", help="scale or inspect the verifier pool of a running job")
    vs.add_argument("action", choices=["scale", "status"])
    vs.add_argument("n", nargs="?", type=int, help="new pool size (scale; an integer >= 1)")
    vs.add_argument("--address", help="Ray address (default: RAY_ADDRESS or auto)")
    vs.set_defaults(fn=cmd_verifiers)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dice-ray`` console script."""
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
