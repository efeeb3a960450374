"""The `dice-ray` command line: verify's JSON contract and exit codes, config errors before any actor."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

RELU = Path(__file__).parents[1] / "dice_ray/tasks/builtin/L1_01_relu"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dice_ray.cli", *args], capture_output=True, text=True, timeout=300)


def _main(capsys, *args) -> tuple[int, str, str]:
    """``dice-ray ARGS`` in this process: ``(exit code, stdout, stderr)``. For the input errors caught before
    anything starts (a process of its own costs ~3 s of imports a call); asserts no Ray was started."""
    import ray

    from dice_ray.cli import main

    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out = capsys.readouterr()
    assert not ray.is_initialized(), f"dice-ray {' '.join(map(str, args))} started Ray"
    return rc, out.out, out.err


def test_verify_json_has_the_contract_fields():
    proc = _cli("verify", "--task", str(RELU / "reference.py"), "--candidate", str(RELU / "solution.py"), "--json")
    assert proc.returncode == 0, proc.stderr
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("verdict", "compiled", "correct", "speedup", "reward", "reason"):
        assert key in verdict
    assert verdict["verdict"] == "ok" and verdict["compiled"] is True and verdict["reward"] > 0


def test_verify_bad_candidate_is_a_verdict_not_an_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text((RELU / "solution.py").read_text().replace("__global__", "__global__ int", 1))
    proc = _cli("verify", "--task", str(RELU / "reference.py"), "--candidate", str(bad), "--json")
    assert proc.returncode == 0
    assert json.loads(proc.stdout.strip().splitlines()[-1])["verdict"] == "compile_error"


@pytest.mark.parametrize("task", ["/no/such/file.py", "BROKEN"])
def test_verify_unusable_input_exits_2_with_one_line(tmp_path, task, capsys):
    if task == "BROKEN":
        task = tmp_path / "t.py"
        task.write_text("class Model(:\n")
    rc, _, err = _main(capsys, "verify", "--task", task, "--candidate", RELU / "solution.py")
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "dice-ray: error:" in err


def test_train_bad_config_fails_before_any_actor(capsys):
    rc, out, err = _main(capsys, "train", "rl.num_generationz=4")
    assert rc == 2
    assert "num_generationz" in err and "ray" not in out.lower()


@pytest.mark.parametrize("args, says", [(["rl.bogus=1"], "rl.bogus: unknown key"), (["--config", "/no/such.yaml"], "no such file"),
                                        (["model.path=dice-test/absent"], "'dice-test/absent': no local folder"),
                                        (["model.path=/no/such/policy"], "not a hub id"),
                                        (["cluster.fused_kernels=liger"], "needs a GPU learner"),
                                        (["sampling.max_new_tokens=30"],  # a rule across fields: no "(top level)"
                                         "error: config: sampling.max_new_tokens=30 must be a multiple of model.block_size")])
def test_config_errors_are_one_line(args, says, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id not in the cache fails at once, before Ray starts
    rc, _, err = _main(capsys, "train", *args)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("n", ["0", "-3", None])
def test_verifiers_scale_needs_a_positive_size(n, capsys):
    # checked before connecting to Ray: exit 2 and one line even with no cluster running
    rc, _, err = _main(capsys, "verifiers", "scale", *([n] if n is not None else []), "--address", "127.0.0.1:1")
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "N must be an integer >= 1" in err


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["cluster.min_verifiers=3", "cluster.max_verifiers=2"], "cluster.max_verifiers=2 must be >= cluster.min_verifiers=3"),
        (["cluster.verifier_autoscale=true", "cluster.num_verifiers=5", "cluster.max_verifiers=4"], "cluster.num_verifiers=5"),
        (["cluster.verifier_target_queue=0"], "cluster.verifier_target_queue"),
    ],
)
def test_verifier_autoscaling_bounds_are_checked(overrides, says, capsys):
    rc, _, err = _main(capsys, "train", *overrides)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err



def _closed_port() -> int:
    """A local TCP port with nothing listening (bound a moment, then closed)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_MAIN = "import sys; from dice_ray.cli import main; sys.exit(main(sys.argv[1:]))"
#: as if no Ray ran on this machine (Ray's 'auto' takes a GCS process it finds before the record; another
#: session's may be running here)
_NO_OTHER_RAY = ("from ray._private import services; none = lambda: frozenset(); none.cache_clear = lambda: None; "
                 "services.find_gcs_addresses = none; " + _MAIN)


#: Ray's own connection retries took 10 min 22 s to give up: a command that fails "in seconds" ends well inside this
#: guard even on cores slowed several-fold, and one back on Ray's retries runs into it (s)
RETRY_GUARD_S = 300


def _fresh_cli(*args, ray_tmpdir=None, **env):
    """``dice-ray ARGS`` in a fresh process without RAY_ADDRESS or RAY_AUTH_*, within :data:`RETRY_GUARD_S`; with
    ``ray_tmpdir``, Ray's temp dir (where it records the latest cluster started on this machine) is that one, and no
    other Ray runs on this machine (:data:`_NO_OTHER_RAY`). Returns the CompletedProcess."""
    import os

    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")}
    if ray_tmpdir is not None:
        base["RAY_TMPDIR"] = str(ray_tmpdir)
    return subprocess.run([sys.executable, "-c", _NO_OTHER_RAY if ray_tmpdir is not None else _MAIN, *args],
                          env=base | env, capture_output=True, text=True, timeout=RETRY_GUARD_S)


def _record(tmp_path, address: str):
    """A Ray temp dir whose latest-cluster record (what `ray start` writes, `ray stop` removes) holds ``address``."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(address)
    return tmp_path


def test_status_with_an_address_nobody_answers_fails_fast():
    address = f"127.0.0.1:{_closed_port()}"
    run = _fresh_cli("status", "--address", address)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"no Ray cluster answers at {address} (connection refused), the address from --address" in run.stderr
    assert "RAY_AUTH_MODE" not in run.stderr


@pytest.mark.parametrize("command", [["status"], ["verifiers", "status"], ["verifiers", "scale", "2"]])
def test_a_stale_cluster_record_fails_in_seconds_and_says_so(command, tmp_path):
    """No --address: Ray's 'auto' is the latest cluster recorded on this machine, which may be gone (killed, not
    `ray stop`ped). The command fails in seconds naming the address, the record it came from and what to do;
    no token hint, since nothing answered."""
    import re

    port = _closed_port()
    run = _fresh_cli(*command, ray_tmpdir=_record(tmp_path, f"127.0.0.1:{port}"))
    err = run.stderr.strip()
    assert run.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    # Ray reads a loopback address in the record as this machine's own IP address
    assert re.match(rf"dice-ray: error: no Ray cluster answers at \S+:{port} \(connection refused\), the address from "
                    + re.escape(f"the latest local cluster record ({tmp_path / 'ray' / 'ray_current_cluster'}"), err), err
    assert "a stale record of a cluster that is gone" in err and "--address HOST:PORT" in err
    assert "RAY_AUTH_MODE" not in err and "Failed to connect" not in err


def test_a_recorded_port_that_accepts_but_is_no_ray_cluster_fails_in_seconds(tmp_path):
    """The fresh-user trial's case: the recorded port accepts TCP connections (a hung process of the cluster
    that is gone, or another program that took the port) but no Ray GCS replies. ray.init retried 20 times for
    ~30 s each: 10 min 22 s, then blamed token authentication."""
    import socket

    with socket.socket() as silent:  # listening, never accepting: the kernel completes the handshake, nobody replies
        silent.bind(("", 0))  # every interface: Ray reads 127.0.0.1 in the record as this machine's own address
        silent.listen(16)
        port = silent.getsockname()[1]
        run = _fresh_cli("verifiers", "status", ray_tmpdir=_record(tmp_path, f"127.0.0.1:{port}"))
    err = run.stderr.strip()
    assert run.returncode == 2, err[-2000:]
    assert f":{port} (the port accepts connections but no Ray GCS replied within" in err, err
    assert "ray_current_cluster" in err and "--address HOST:PORT" in err and "RAY_AUTH_MODE" not in err


def test_train_given_an_address_nobody_answers_fails_in_seconds_in_one_line(tmp_path):
    address = f"127.0.0.1:{_closed_port()}"
    run = _fresh_cli("train", "--address", address, f"run_dir={tmp_path / 'runs'}")
    err = run.stderr.strip()
    assert run.returncode == 2 and "Traceback" not in err, err[-2000:]
    assert err == (f"dice-ray: error: no Ray cluster answers at {address} (connection refused): none runs there now "
                   "(not started yet, or already ended); start that cluster first (`ray start --head` prints its "
                   "address), or leave --address and cluster.address out to start a local one")


def test_a_head_that_refuses_the_connection_gets_the_token_hint(tmp_path):
    """A GCS that answers UNAUTHENTICATED (a token-authentication head given no token, or the wrong one): the
    error says it answered and refused, and what to set; found by Ray's 'auto' (no --address), that it may be
    another session's cluster (a fresh-user trial's status took another session's)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    class Refuse(grpc.GenericRpcHandler):
        def service(self, handler_call_details):
            def deny(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing")
            return grpc.unary_unary_rpc_method_handler(deny)

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((Refuse(),))
    port = server.add_insecure_port("[::]:0")  # every interface: Ray reads 127.0.0.1 in a record as this machine's IP
    server.start()
    try:
        run = _fresh_cli("status", "--address", f"127.0.0.1:{port}")
        found = _fresh_cli("status", ray_tmpdir=_record(tmp_path, f"127.0.0.1:{port}"))
    finally:
        server.stop(None)
    err = run.stderr.strip()
    assert run.returncode == 2, err[-2000:]
    assert f"the Ray cluster at 127.0.0.1:{port} (the address from --address) answered but refused" in err
    assert "export RAY_AUTH_MODE=token" in err and "no Ray cluster answers" not in err and "another" not in err
    assert found.returncode == 2 and "answered but refused" in found.stderr, found.stderr[-2000:]
    assert "another user's or session's cluster on this machine: pass your job's --address" in found.stderr


def test_without_a_record_or_a_cluster_on_this_machine_it_says_none_was_found(tmp_path, monkeypatch):
    import ray
    from ray._private import services

    from dice_ray import cli

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no latest-cluster record
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    nothing = lambda: frozenset()  # noqa: E731 - no GCS process running here (another session's may be)
    nothing.cache_clear = lambda: None
    monkeypatch.setattr(services, "find_gcs_addresses", nothing)
    with pytest.raises(ConnectionError, match="no Ray cluster found on this machine") as info:
        cli._connect(None)
    assert "--address HOST:PORT" in str(info.value) and "Could not find" not in str(info.value)  # not Ray's words again


def test_config_prints_the_resolved_config_and_describes_every_key(capsys):
    import yaml

    from dice_ray.cli import main

    assert main(["config", "rl.steps=3", "verify.timing_window_ms=0.5"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["rl"]["steps"] == 3 and tree["verify"]["timing_window_ms"] == 0.5
    assert main(["config", "--describe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = {line.split(" = ")[0] for line in lines}
    assert {"rl.steps", "verify.timing_window_ms", "cluster.num_verifiers", "run_dir"} <= keys
    assert any(line.startswith("verify.timing_window_ms = 0.125  # Least GPU time (ms)") for line in lines)
    assert main(["config", "verify.nope=1"]) == 2
    assert capsys.readouterr().err.strip() == "dice-ray: error: config: verify.nope: unknown key"
    assert main(["config", "--describe", "verify.spare_workers"]) == 2  # a key, not an override: say how to see one
    assert "dice-ray config --describe | grep verify.spare_workers" in capsys.readouterr().err


def test_config_errors_name_every_bad_key_in_one_line(capsys, tmp_path):
    from dice_ray.cli import main

    assert main(["config", "rl.steps=true", "rl.bogus=1", "rl.num_generations=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dice-ray: error: config: ") and len(err.splitlines()) == 1
    for part in ("rl.steps: expected a number, got true", "rl.bogus: unknown key",
                 "rl.num_generations: Input should be greater than or equal to 2"):
        assert part in err
    typo = tmp_path / "typo.yaml"  # a key of the file is said to be there; one the overrides set is not
    typo.write_text("rl:\n  stepz: 3\n")
    assert main(["config", "--config", str(typo), "rl.num_generations=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"rl.stepz: unknown key (did you mean rl.steps?) (in {typo})" in err, err
    assert "rl.num_generations: Input should be greater than or equal to 2;" in err, err  # no "(in ...)": an override
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl:\n  steps: [1\n")
    assert main(["config", "--config", str(bad)]) == 2  # was a yaml traceback, exit 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"config {bad}: line 3, column 1: not valid YAML" in err


@pytest.mark.parametrize("spec, says", [("dice:{tmp}/absent.json", "does not exist"),
                                        ("jsonl:{tmp}/empty.jsonl", "no task accepted (jsonl:"),
                                        ("dice:{tmp}/bad.json", "bad-json: 1)): rejected {tmp}/bad.json[file]: bad-json: ")])
def test_train_bad_tasks_fail_before_ray_or_a_run_folder(tmp_path, spec, says, capsys):
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.json").write_text("[{")
    rc, out, err = _main(capsys, "train", "--tasks", spec.format(tmp=tmp_path), f"run_dir={tmp_path / 'runs'}")
    assert rc == 2 and says.format(tmp=tmp_path) in err, err
    assert len(err.strip().splitlines()) == 1
    assert "ray" not in out.lower() and not (tmp_path / "runs").exists()  # was: Ray started, run folder left


def test_status_summary_names_phase_step_rewards_and_pool():
    from dice_ray.cli import describe_status

    status = {"schedule": {"step": 7, "pools": {"infill": {"epoch": 0, "position": 14}, "e2e": {"epoch": 1, "position": 2}},
                           "infill_fraction": 0.5, "phase": "ramp", "curriculum": {"holding": False}},
              "last_decision": {"step": 6, "action": "leave-infill", "reason": "compile_rate 0.72 (mean of steps 4-5) >= "
                                "phase.gate_threshold=0.7"},
              "last_step": {"step": 5, "reward_mean": 0.4213, "reward_std": 0.1, "compile_rate": 0.75, "correct_rate": None,
                            "cheat_rate": 0.0, "speedup_geomean": None, "candidates": 8, "step_seconds": 12.34},
              "verifier_pool": {"size": 3, "serving": 2, "draining": 1, "queue_depth": 4, "in_flight": 2, "completed": 120,
                                "throughput_per_s": 2.125}}
    lines = describe_status(status).splitlines()
    assert lines == [
        "phase ramp (infill fraction 0.50); next step to sample 7 (infill epoch 0, position 14; e2e epoch 1, position 2)",
        "curriculum: step 6 leave-infill: compile_rate 0.72 (mean of steps 4-5) >= phase.gate_threshold=0.7",
        "last finished step 5: reward 0.421 (std 0.100), compile 0.75, correct n/a, cheat 0.00, speedup n/a, "
        "8 candidates in 12.3 s",
        "verifier pool: 3 actors (2 serving, 1 draining), queue 4, in flight 2, 120 verified, 2.12 candidates/s since it started"]
    assert describe_status({**status, "last_step": {}}).splitlines()[2] == "no step finished yet"
    assert describe_status({**status, "last_decision": None}).splitlines()[1] == "curriculum: no decision yet"
    # a resumed run before the scheduler's state is restored: not the fresh schedule's step 0
    assert describe_status({**status, "restoring": True}).splitlines()[0].startswith("resuming: the scheduler's state")


def test_verifiers_status_is_a_line_for_the_pool_and_one_an_actor():
    from dice_ray.cli import describe_actors

    pool = {"size": 2, "serving": 1, "draining": 0, "queue_depth": 5, "in_flight": 3, "completed": 40, "throughput_per_s": 4.0,
            "autoscale": {"min": 1, "max": 4, "cooldown_s": 30.0},
            "actors": [{"index": 0, "state": "serving", "node": "10.0.0.2", "gpu": ["0"], "capacity": 6, "in_flight": 3,
                        "done": 40, "failures": 0, "restarts": 1, "utilization": 0.5, "error": None},
                       {"index": 1, "state": "starting", "node": None, "gpu": [], "capacity": 6, "in_flight": 0, "done": 0,
                        "failures": 2, "restarts": 0, "utilization": 0.0, "error": "actor died\ntraceback..."}]}
    assert describe_actors(pool).splitlines() == [
        "verifier pool: 2 actors (1 serving, 0 draining), queue 5, in flight 3, 40 verified, 4.00 candidates/s since it started",
        "  actor 0: serving on 10.0.0.2 GPU 0, in flight 3/6, 40 verified, 0 failures, 1 restarts, utilization 0.50",
        "  actor 1: starting on ? (no GPU), in flight 0/6, 0 verified, 2 failures, 0 restarts, utilization 0.00; "
        "error: actor died",
        "autoscaling between 1 and 4 actors by queue depth"]
    # the actors' sandbox spares, when they answered the status call
    pool["actors"][0]["sandbox"] = {"workers": 6, "restarts": 3, "spares": 8, "spares_ready": 7, "promoted": 1}
    pool.update(spares=8, spares_ready=7, promoted=1)
    lines = describe_actors(pool).splitlines()
    assert lines[0].endswith("; spare sandbox workers 7/8 ready, 1 replacements found none ready")
    assert lines[1].endswith("utilization 0.50; sandbox workers 6 (3 replaced), spares 7/8 ready, 1 replacements found none ready")
    # the reference facts each actor measured at start (VerifierPool.prepare), or why it measured none
    pool["actors"][0]["prepared"] = {"measured": 20, "known": 1, "failed": {"t/bad": "invalid_input"}, "seconds": 0.8}
    pool["actors"][1]["prepared"] = {"measured": 0, "known": 0, "failed": {}, "skipped": "compile-only: no reference runs"}
    lines = describe_actors(pool).splitlines()
    assert lines[1].endswith("; reference facts 20 measured at start, 1 known, 1 failed")
    assert lines[2].endswith("; reference facts compile-only: no reference runs; error: actor died")


def test_status_refuses_the_dashboard_url_in_one_line(capsys):
    from dice_ray.cli import main

    assert main(["verifiers", "status", "--address", "http://127.0.0.1:8265"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dashboard / job-submission URL" in err[0] and "HOST:6379" in err[0]


def test_status_names_a_dashboard_url_in_ray_address(capsys, monkeypatch):
    from dice_ray.cli import main

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # what `ray job submit` users export
    assert main(["status"]) == 2
    assert "RAY_ADDRESS=http://127.0.0.1:8265 is a dashboard" in capsys.readouterr().err


def test_output_into_a_pipe_closed_early_ends_quietly():
    """`dice-ray config --describe | head -1`: no BrokenPipeError traceback, exit 141 as a shell reports it."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "dice_ray.cli", "config", "--describe"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command (a second of imports) writes anything: its first write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "Exception ignored" not in err, err


def test_unknown_config_key_names_the_nearest_known_one(capsys):
    from dice_ray.cli import main

    assert main(["config", "rl.num_generation=8", "verify.rtoll=1", "zzz=3"]) == 2
    err = capsys.readouterr().err
    assert "rl.num_generation: unknown key (did you mean rl.num_generations?)" in err
    assert "verify.rtoll: unknown key (did you mean verify.rtol?)" in err
    assert "zzz: unknown key;" in err or err.rstrip().endswith("zzz: unknown key")
    assert main(["config", "steps=3", "rl_steps=3", "num_generations=4"]) == 2
    err = capsys.readouterr().err
    assert "steps: unknown key (did you mean sft.steps or rl.steps?)" in err, err  # no section: every section's
    assert "rl_steps: unknown key (did you mean rl.steps?)" in err and "num_generations: unknown key (did you " \
        "mean rl.num_generations?)" in err, err


def test_train_interrupted_says_how_far_it_got_and_how_to_resume(tmp_path, monkeypatch, capsys):
    """Ctrl-C during `dice-ray train`: no traceback, exit 130, the steps done and the --resume command."""
    from dice_ray.cli import main
    from dice_ray.cluster import trainer as trainer_mod

    def interrupted(self) -> dict:
        self.run_dir.mkdir(parents=True)
        (self.run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod.Trainer, "run", interrupted)
    before = signal.getsignal(signal.SIGINT)
    try:
        assert main(["train", f"run_dir={tmp_path}", "run_name=stopped", "rl.steps=5"]) == 130
        calm = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert calm is not before
    calm(signal.SIGINT, None)  # a second Ctrl-C while it shuts down only says so (it printed Ray's tracebacks)
    out = " ".join(capsys.readouterr().out.split())
    assert "stopping: the actors and Ray are shutting down" in out
    assert "stopped (interrupted) with 2 of 5 steps done" in out
    assert f"dice-ray train --resume {tmp_path / 'stopped'}" in out
    # dice-ray report says so, not "still running" (a fresh user's report of a run stopped minutes before)
    from dice_ray.report import load_run, markdown_report

    stopped = json.loads((tmp_path / "stopped" / "stopped.json").read_text())
    assert stopped["reason"] == "interrupted" and (stopped["steps_done"], stopped["steps"]) == (2, 5)
    report = markdown_report(load_run(tmp_path / "stopped"))
    assert report.startswith("# dice-ray run `stopped` (stopped)") and "still running" not in report
    assert "Status: stopped (interrupted) at " in report and "with 2 of 5 steps done" in report


def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path, monkeypatch, capsys):
    """SIGTERM (``ray job stop``) printed a Ray stack trace and exited 134 with no resume hint (a fresh user's trial):
    now a real SIGTERM to the process stops the run like Ctrl-C, exit 143, stopped.json says why, and the
    process's own SIGTERM handler is back afterwards."""
    import os
    import time

    from dice_ray.cli import main
    from dice_ray.cluster import trainer as trainer_mod

    def terminated(self):
        self.run_dir.mkdir(parents=True)
        (self.run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises in this thread before this ends
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(trainer_mod.Trainer, "run", terminated)
    before = signal.getsignal(signal.SIGTERM)
    before_int = signal.getsignal(signal.SIGINT)
    try:
        assert main(["train", f"run_dir={tmp_path}", "run_name=t", "rl.steps=4"]) == 143
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)
    out = " ".join(capsys.readouterr().out.split())
    assert "stopped (terminated (SIGTERM)) with 1 of 4 steps done" in out
    assert f"dice-ray train --resume {tmp_path / 't'}" in out
    assert json.loads((tmp_path / "t" / "stopped.json").read_text())["reason"] == "terminated (SIGTERM)"


_SIGTERM_AFTER_RAY = """
import os, signal, sys, time
from dice_ray.cluster.ray_start import start_ray

got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
start_ray(None)  # a private local cluster: ray.init installs Ray's own C-level SIGTERM handler in this driver
os.kill(os.getpid(), signal.SIGTERM)
for _ in range(100):
    if got:
        break
    time.sleep(0.05)
print("handled" if got else "not handled", flush=True)
"""


def test_the_python_sigterm_handler_stays_in_force_after_ray_starts():
    """Ray's driver put its own C-level SIGTERM handler over Python's (it prints a stack and aborts: exit 134, a fresh
    user's trial), so the trainer's handler never ran on a real run; the test above mocks the run and starts no Ray.
    After start_ray the process's Python handler gets the signal."""
    out = subprocess.run([sys.executable, "-c", _SIGTERM_AFTER_RAY], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_ADDRESS": ""})
    assert out.returncode == 0 and out.stdout.split("\n")[-2:] == ["handled", ""], \
        (out.returncode, out.stdout, out.stderr[-2000:])


def test_train_refuses_a_run_name_that_holds_a_run(tmp_path, monkeypatch, capsys):
    """A second `dice-ray train run_name=r` appended to r's metrics, overwrote its config and rotated its checkpoints
    away (a fresh user's trial, stop 38): it is refused before anything starts, with the --resume command; a folder
    without a run is used, and a default timestamp another run took gets -2."""
    from dice_ray.cli import main
    from dice_ray.cluster import run_folder
    from dice_ray.cluster import trainer as trainer_mod
    from dice_ray.config import DiceConfig

    started = []
    monkeypatch.setattr(trainer_mod.Trainer, "run", lambda self: started.append(self.run_dir) or {})
    monkeypatch.setattr(trainer_mod.Trainer, "shutdown", lambda self: None)
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(["train", f"run_dir={tmp_path}", "run_name=r"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"run_name=r: {tmp_path / 'r'} already holds a run (metrics.jsonl, checkpoints)" in err
    assert f"`dice-ray train --resume {tmp_path / 'r'}` continues it" in err and not started
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == '{"step": 0}\n'  # untouched
    (tmp_path / "empty").mkdir()
    assert run_folder.new_run_dir(DiceConfig(run_dir=str(tmp_path), run_name="empty")) == tmp_path / "empty"

    class Frozen:  # two runs started in the same second
        @staticmethod
        def now():
            from datetime import datetime
            return datetime(2026, 12, 3, 17, 0, 0)

    monkeypatch.setattr(run_folder, "datetime", Frozen)
    (tmp_path / "20261203-170000").mkdir()
    (tmp_path / "20261203-170000-2").mkdir()
    assert run_folder.new_run_dir(DiceConfig(run_dir=str(tmp_path))) == tmp_path / "20261203-170000-3"


def test_train_that_fails_leaves_the_reason_for_report(tmp_path, monkeypatch, capsys):
    from dice_ray.cli import main
    from dice_ray.cluster import trainer as trainer_mod
    from dice_ray.report import load_run

    def fails(self) -> dict:
        self.run_dir.mkdir(parents=True)
        (self.run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
        raise ValueError("verifier pool gone\nmore")

    monkeypatch.setattr(trainer_mod.Trainer, "run", fails)
    assert main(["train", f"run_dir={tmp_path}", "run_name=r", "rl.steps=5"]) == 2
    run = load_run(tmp_path / "r")
    assert run.state == "stopped" and run.stopped["reason"] == "ValueError: verifier pool gone"


def _finished_run(tmp_path: Path, steps_done: int) -> Path:
    """A run folder as `dice-ray train` leaves it: the resolved config and a checkpoint of ``steps_done`` steps."""
    import yaml

    from dice_ray.config import DiceConfig

    run = tmp_path / "run"
    (run / "checkpoints" / f"step_{steps_done:06d}").mkdir(parents=True)
    (run / "checkpoints" / f"step_{steps_done:06d}" / "state.json").write_text(json.dumps({"step": steps_done}))
    (run / "config.yaml").write_text(yaml.safe_dump(DiceConfig().model_dump(mode="json"), sort_keys=False))
    return run


@pytest.mark.parametrize("overrides, says", [
    (["rl.steps=5"], "rl.steps=5, and its newest checkpoint (step_000007) already holds 7 steps: nothing to do; "
                     "pass rl.steps=8 or more"),
    (["rl.steps=7"], "nothing to do"),
    (["rl.steps=11", "model.hidden_size=64"], "model.hidden_size cannot change on resume (the run has 128, asked 64)"),
    (["rl.steps=11", "tasks.max_tasks=3"], "tasks.max_tasks cannot change on resume"),
])
def test_resume_refuses_what_it_cannot_do_before_starting_anything(tmp_path, monkeypatch, capsys, overrides, says):
    """A resume with nothing left to do, or with another policy shape or task list, fails in the CLI with one line
    and leaves the run folder as it was (it used to start Ray, then fail in the learner's checkpoint load with a
    traceback, having written the new shape into config.yaml, so every later resume failed too)."""
    from dice_ray.cli import main
    from dice_ray.cluster import trainer as trainer_mod

    run = _finished_run(tmp_path, 7)
    before = (run / "config.yaml").read_text()
    monkeypatch.setattr(trainer_mod, "Trainer", lambda *a, **k: pytest.fail("a Trainer was made"))
    assert main(["train", "--resume", str(run), *overrides]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"dice-ray: error: --resume {run}: " in err and says in err, err
    assert (run / "config.yaml").read_text() == before
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml"]


def test_train_refuses_a_broken_model_folder_before_starting_anything(tmp_path, capsys):
    """``model.path`` naming a folder that lacks a file (here tokenizer.json) is one line and exit 2 from the CLI,
    before Ray or the run folder exist (it used to start Ray and fail in the learner's and every rollout worker's
    constructor, ~100 lines of interleaved tracebacks with colour codes)."""
    import ray

    from dice_ray.cli import main
    from dice_ray.config import ModelConfig
    from dice_ray.policy.policy import DiffusionPolicy

    from _helpers import TINY_FAMILY_SHAPE

    DiffusionPolicy.build(ModelConfig(**TINY_FAMILY_SHAPE)).save_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").unlink()
    assert main(["train", f"run_dir={tmp_path / 'runs'}", f"model.path={tmp_path / 'ckpt'}", "rl.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"dice-ray: error: checkpoint {tmp_path / 'ckpt'}: missing tokenizer.json"
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


@pytest.fixture
def local_ray(ray_head):
    import ray

    from _helpers import joined_ray

    with joined_ray(ray_head, namespace="dice-ray-test-cli"):
        yield ray


def test_an_actor_failure_ends_train_with_one_line_naming_the_actor_and_its_error(local_ray, monkeypatch, capsys):
    """Whatever an actor raises (in its constructor or a method) ends ``dice-ray train`` (and ``eval``) with exit 1
    and a last line that names the actor's method and the exception, without Ray's traceback or colour codes."""
    from dice_ray.cli import main
    from dice_ray.cluster.errors import error_line
    from dice_ray.cluster import trainer as trainer_mod
    from dice_ray.eval import run as eval_mod

    @local_ray.remote(num_cpus=0)
    class Learner:
        def __init__(self, fail: bool = False):
            if fail:
                raise FileNotFoundError("checkpoint /x: missing tokenizer.json")

        def train_step(self):
            raise ValueError("batch of 0 groups\nsecond line")

        def ping(self):
            return 1

    def raised(call) -> BaseException:
        try:
            local_ray.get(call())
        except local_ray.exceptions.RayError as e:
            return e
        pytest.fail("no error")

    died_in_init = raised(lambda: Learner.remote(True).ping.remote())
    assert error_line(died_in_init) == "Learner.__init__ failed: FileNotFoundError: checkpoint /x: missing tokenizer.json"
    in_method = raised(lambda: Learner.remote().train_step.remote())
    assert isinstance(in_method, ValueError)  # a RayTaskError(ValueError): the CLI must not print it as a bad input
    assert error_line(in_method) == "Learner.train_step failed: ValueError: batch of 0 groups"

    def train(*_a, **_k):
        raise in_method

    monkeypatch.setattr(trainer_mod, "train", train)
    assert main(["train"]) == 1
    err = capsys.readouterr().err
    assert err == "dice-ray: error: Learner.train_step failed: ValueError: batch of 0 groups\n"
    monkeypatch.setattr(eval_mod, "evaluate", train)  # eval's GPU verifier pool is an actor too
    assert main(["eval", "--tasks", "builtin", "--solutions", "x"]) == 1
    assert capsys.readouterr().err.endswith("Learner.train_step failed: ValueError: batch of 0 groups\n")
