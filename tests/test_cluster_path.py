"""The cluster path as a new user runs it: cluster.yaml against Ray's own validation, the configs/
presets through load_config, and (slow) ``ray start --head`` -> ``ray job submit`` of a short train ->
``dice-ray verifiers scale 2`` while it runs -> ``dice-ray status`` shows it -> the head stopped.

The head gets its own ports and temp dir, so another Ray instance on the machine is left alone; it is
stopped by killing the processes that carry that temp dir (``ray stop`` would stop every Ray on the host).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from dice_ray.config import DiceConfig, load_config

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PRESETS = sorted((REPO / "configs").glob("*.yaml"))


# -- cluster.yaml: Ray's own checks, as `ray up` runs them (prepare_config, then validate_config) --------

def _ray_checked(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.fixture(scope="module")
def launcher() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_cluster_yaml_passes_rays_validation(launcher):
    prepared = _ray_checked(launcher)
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    workers = [t for name, t in types.items() if name != prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] > 0  # a CPU head
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers)  # GPU workers
    assert prepared["provider"]["type"] == "aws"
    # the setup commands install the synced repository (dice-ray) on every node
    repo_dirs = [remote for remote, local in prepared["file_mounts"].items() if local == "."]
    assert repo_dirs, prepared["file_mounts"]
    assert any(f"cd {repo_dirs[0]}" in c and "pip install -e '.[gpu]'" in c for c in prepared["setup_commands"])
    assert any("ray start --head" in c for c in prepared["head_start_ray_commands"])


@pytest.mark.parametrize(
    "breakage",
    [
        lambda c: c.update(max_wokers=8),  # unknown top-level key
        lambda c: c["available_node_types"]["gpu_worker"].update(min_workers="two"),
        lambda c: c["provider"].pop("type"),
    ],
    ids=["unknown-key", "bad-value", "missing-provider-type"],
)
def test_rays_validation_rejects_a_broken_cluster_yaml(launcher, breakage):
    broken = copy.deepcopy(launcher)
    breakage(broken)
    with pytest.raises((jsonschema.ValidationError, KeyError, ValueError)):
        _ray_checked(broken)


def test_cluster_8b_preset_fits_the_launcher_gpus(launcher):
    cfg = load_config(REPO / "configs" / "cluster-8b.yaml")
    gpu_type = launcher["available_node_types"]["gpu_worker"]
    c = cfg.cluster
    asked = c.num_verifiers * c.verifier_gpus + c.num_rollout_workers * c.rollout_gpus + c.learner_ranks * c.learner_gpus
    assert asked == gpu_type["min_workers"] * gpu_type["resources"]["GPU"]


# -- configs/: every preset loads; the default one is the embedded default; bad keys are named ----------

def test_presets_exist():
    assert {p.stem for p in PRESETS} >= {"default", "h200", "8gpu", "cluster-8b"}


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_loads(preset):
    cfg = load_config(preset)
    assert isinstance(cfg, DiceConfig)
    assert cfg.sampling.max_new_tokens % cfg.model.block_size == 0


def test_default_preset_is_the_embedded_default():
    assert load_config(REPO / "configs" / "default.yaml") == DiceConfig()


def test_gpu_presets_write_out_their_split():
    one = load_config(REPO / "configs" / "h200.yaml").cluster
    assert one.num_verifiers * one.verifier_gpus + one.rollout_gpus + one.learner_gpus == 1.0
    eight = load_config(REPO / "configs" / "8gpu.yaml").cluster
    assert eight.num_verifiers * eight.verifier_gpus + eight.num_rollout_workers * eight.rollout_gpus \
        + eight.learner_ranks * eight.learner_gpus == 8.0


def test_cluster_8b_preset_has_the_dice_8b_shape():
    m = load_config(REPO / "configs" / "cluster-8b.yaml").model
    shape = (m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.num_attention_heads,
             m.num_key_value_heads, m.head_dim, m.block_size)
    assert shape == (4096, 12288, 36, 32, 8, 128, 4)
    assert m.path and m.dtype == "bfloat16"


@pytest.mark.parametrize(
    "edit, named",
    [("cluster:\n  num_verifers: 2\n", "num_verifers"), ("rl:\n  ppo_epochs: 0\n", "ppo_epochs")],
)
def test_a_bad_preset_key_or_value_fails_naming_it(tmp_path, edit, named):
    text = (REPO / "configs" / "8gpu.yaml").read_text()
    section, line = edit.splitlines()
    assert f"{section}\n" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(f"{section}\n", f"{section}\n{line}\n", 1))
    with pytest.raises(ValidationError, match=named):
        load_config(bad)


# -- the whole path on a private local head ------------------------------------------------------------

def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _stop_head(temp_dir: str) -> None:
    """Stop the Ray processes of this head only: those whose command line names its temp dir, and their children."""
    import psutil

    mine = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and any(temp_dir in a for a in (p.info["cmdline"] or [])):
                mine.append(p)
        except psutil.Error:
            pass
    procs = {p.pid: p for p in mine}
    for p in mine:
        try:
            procs.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            pass
    for p in procs.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    # the dashboard and the raylet go within a second or so; GCS and the autoscaler monitor outlive a SIGTERM
    # by 15 s and more (what `ray stop` would wait for): a head of its own, nothing to flush, so they are killed
    _, alive = psutil.wait_procs(list(procs.values()), timeout=2)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    shutil.rmtree(temp_dir, ignore_errors=True)


def _cli(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=False, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _head_env(**extra: str) -> dict:
    """This environment less every RAY_* variable, with this venv's `python` and `ray` first on PATH."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
        "RAY_USAGE_STATS_ENABLED": "0", **extra}


def _start_head(temp_dir: str, env: dict) -> tuple[str, str]:
    """``ray start --head`` on 127.0.0.1 with ports of its own and ``temp_dir``; returns (GCS address, dashboard URL)."""
    gcs, dash, client, agent, agent_grpc, metrics, env_agent, node_mgr, obj_mgr = _free_ports(9)
    start = _cli([str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                  f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}",
                  f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
                  f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
                  f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
                  "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temp_dir}", "--disable-usage-stats"], env)
    assert start.returncode == 0, start.stdout + start.stderr
    return f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}"


_PRIVATE_START = """
import json
from ray._private import services
from dice_ray.cluster.ray_start import start_ray

would_join = services.canonicalize_bootstrap_address(None)  # what a plain ray.init() joins here
info = start_ray(None)
import ray
print(json.dumps({"would_join": would_join, "started": info["started"], "address": info["address"],
                  "nodes": len(ray.nodes())}))
ray.shutdown()
"""


@pytest.mark.slow
def test_dice_ray_train_starts_a_private_cluster_beside_a_ray_start_head():
    """``ray start --head`` on a shared machine records itself in Ray's temp dir, and a plain ``ray.init()`` there
    joins it (someone else's resources and dashboard, and its end). With no address given, dice-ray's start
    (:func:`~dice_ray.cluster.ray_start.start_ray`) starts a cluster of its own beside it instead."""
    ray_tmpdir = tempfile.mkdtemp(prefix="dcf", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    temp_dir = os.path.join(ray_tmpdir, "ray")  # the head's temp dir is the default one of RAY_TMPDIR: recorded there
    env = _head_env(RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmpdir)
    try:
        try:
            foreign, _ = _start_head(temp_dir, env)
        except AssertionError:  # Ray gives its raylet 30 s to register: on cores loaded by other work, once more
            _stop_head(ray_tmpdir)
            os.makedirs(ray_tmpdir)
            foreign, _ = _start_head(temp_dir, env)
        got = _cli([sys.executable, "-c", _PRIVATE_START], env, timeout=300)
        assert got.returncode == 0, got.stderr[-3000:]
        seen = json.loads(got.stdout.splitlines()[-1])
        assert seen["would_join"].endswith(foreign.split(":")[1])  # the trap is set: ray.init() would join the head
        assert seen["started"] and seen["address"] != seen["would_join"] and seen["nodes"] == 1, seen
    finally:
        _stop_head(ray_tmpdir)


@pytest.mark.slow
def test_status_commands_reach_a_token_auth_head_on_this_machine(tmp_path):
    """A head started once a token exists uses token authentication (Ray >= 2.60); Ray sends the token
    for address 'auto' only. `dice-ray verifiers status --address 127.0.0.1:PORT` must still connect at
    once (RAY_AUTH_MODE unset), not retry for 20 s and fail."""
    temp_dir = tempfile.mkdtemp(prefix="dca", dir="/tmp")
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    try:
        address, _ = _start_head(temp_dir, _head_env(HOME=str(home), RAY_AUTH_MODE="token"))
        # the guards (s) sit below Ray's own connection retries (10 min), far above a busy machine's seconds
        got = _cli([sys.executable, "-m", "dice_ray.cli", "verifiers", "status", "--address", address],
                   _head_env(HOME=str(home)), timeout=300)
        assert got.returncode == 2 and "no running dice-ray job on this cluster" in got.stderr, got.stderr[-2000:]
        assert "Unauthenticated" not in got.stderr
        # told to stay without authentication, it fails at once in one line that says the head refused and what
        # to set (dice-ray asks the GCS before ray.init, whose own retries took minutes)
        got = _cli([sys.executable, "-m", "dice_ray.cli", "status", "--address", address],
                   _head_env(HOME=str(home), RAY_AUTH_MODE="disabled"), timeout=300)
        assert got.returncode == 2 and "export RAY_AUTH_MODE=token" in got.stderr.splitlines()[-1], got.stderr[-2000:]
        assert "answered but refused" in got.stderr
    finally:
        _stop_head(temp_dir)


@pytest.mark.slow
def test_job_submit_then_scale_verifiers_while_it_runs(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="dcp", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = _head_env(RAY_AUTH_MODE="disabled")  # leave ~/.ray/auth_token (shared with any other Ray here) untouched
    job_id = None
    run_dir = tmp_path / "runs"
    steps = 6
    try:
        address, dashboard = _start_head(temp_dir, env)
        job_id = f"dice-cluster-path-{uuid.uuid4().hex[:8]}"

        runtime_env = {"excludes": ["runs/", ".venv/", ".devbundle/", ".git/", ".whl/", ".vbench/", ".hypothesis/",
                                    ".pytest_cache/", ".ruff_cache/", "*.egg-info/"]}
        submit = _cli([str(BIN / "ray"), "job", "submit", "--address", dashboard, "--submission-id", job_id,
                       "--working-dir", str(REPO), "--runtime-env-json", json.dumps(runtime_env), "--no-wait", "--",
                       "python", "jobs/train.py", f"run_dir={run_dir}", "run_name=r", f"sft.cache_dir={tmp_path / 'sft'}",
                       f"rl.steps={steps}", "rl.prompts_per_step=2", "rl.num_generations=2", "phase.infill_steps=1",
                       "phase.ramp_steps=1", "sampling.max_new_tokens=96", "sft.steps=40", "eval.heldout_tasks=1",
                       "eval.samples=1", "eval.heldout_samples=1", "eval.train_tasks=1", "cluster.num_verifiers=1",
                       "tasks.max_tasks=12"], env)
        assert submit.returncode == 0, submit.stdout + submit.stderr

        def job_api(path: str = "") -> dict:
            """GET the job from Ray's Jobs REST API (what `ray job status` / `logs` read), from this process: a
            `ray job` command a poll took ~1.5 s of CPU from the job on 2 cores."""
            with urllib.request.urlopen(f"{dashboard}/api/jobs/{job_id}{path}", timeout=30) as reply:
                return json.load(reply)

        def job_status() -> str:
            return job_api()["status"]  # PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED

        def job_logs() -> str:
            return job_api("/logs")["logs"][-4000:]

        dice = [sys.executable, "-m", "dice_ray.cli"]
        deadline = time.monotonic() + 180
        status = None
        while True:  # the trainer names its scheduler and verifier pool once its actors exist, then says "actors ..."
            if "\nactors " in job_api("/logs")["logs"]:
                status = _cli([*dice, "status", "--json", "--address", address], env)
                if status.returncode == 0:
                    break
            state = job_status()
            assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, \
                f"job {state}; status: {status and status.stderr}\n{job_logs()}"
            time.sleep(1)
        before = json.loads(status.stdout)
        assert before["verifier_pool"]["size"] == 1, before
        assert "schedule" in before

        scaled = _cli([*dice, "verifiers", "scale", "2", "--address", address, "--json"], env)
        assert scaled.returncode == 0, scaled.stderr
        assert json.loads(scaled.stdout)["size"] == 2
        t0 = time.monotonic()
        while True:  # both actors serve within seconds
            pool = json.loads(_cli([*dice, "verifiers", "status", "--address", address, "--json"], env).stdout)
            if pool["serving"] == 2:
                break
            assert time.monotonic() - t0 < 60, pool
            time.sleep(1)
        after = json.loads(_cli([*dice, "status", "--json", "--address", address], env).stdout)
        lines = _cli([*dice, "status", "--address", address], env).stdout.splitlines()
        assert len(lines) == 4 and lines[0].startswith("phase ") and lines[1].startswith("curriculum: "), lines
        assert lines[3].startswith("verifier pool: 2 actors (2 serving"), lines
        if after.get("last_step"):  # a finished step's whole record, its time included (not the pre-checkpoint post)
            assert isinstance(after["last_step"].get("step_seconds"), float) and " n/a s" not in lines[2], lines
        assert after["verifier_pool"]["size"] == 2 and after["verifier_pool"]["serving"] == 2, after
        assert job_status() == "RUNNING", "the job ended before the pool was scaled: raise rl.steps"

        deadline = time.monotonic() + 240
        while (state := job_status()) in ("PENDING", "RUNNING"):
            assert time.monotonic() < deadline, job_logs()
            time.sleep(1)
        assert state == "SUCCEEDED", job_logs()
        records = [json.loads(x) for x in (run_dir / "r" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(steps))
        assert records[-1]["verifier_pool_size"] == 2  # the job's own steps saw the scaled pool
    finally:
        if job_id:
            _cli([str(BIN / "ray"), "job", "stop", "--address", dashboard, "--no-wait", job_id], env, timeout=60)
        _stop_head(temp_dir)
