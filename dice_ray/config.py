"""The one typed configuration of a dice-ray run.

Every knob has its default, its meaning and, where it has one, the paper or project it comes from.
Knob names follow TRL's ``GRPOConfig`` where one exists (``num_generations``, ``beta``, ``epsilon``,
``scale_rewards``, ``learning_rate``).  Unknown keys and bad values raise
:class:`pydantic.ValidationError` naming the key, before any actor starts.

Load with :func:`load_config` (YAML file + ``key=value`` overrides in dotted form, e.g.
``rl.num_generations=8``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

#: where DeepSpeed builds its JIT ops (``TORCH_EXTENSIONS_DIR``): once a machine, then cached (here, not in
#: ``dice_ray.policy.deepspeed_setup``, so the driver can name it without importing the policy stack: ~5 s on 2 cores)
DEEPSPEED_OPS_DIR = "~/.cache/dice-ray/torch_extensions"


class _Section(BaseModel):
    # allow_inf_nan=False: an inf tolerance or a NaN reward would pass every candidate or poison every step
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse ``true`` / ``false`` for a number (pydantic's lax mode would read them as 1 / 0)."""
        if isinstance(value, bool) and info.field_name is not None:
            kinds = set(get_args(cls.model_fields[info.field_name].annotation)) or {
                cls.model_fields[info.field_name].annotation}
            if kinds & {int, float} and bool not in kinds:
                raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


class TasksConfig(_Section):
    """Which problems the run trains and evaluates on."""

    spec: str = Field(
        "builtin:24",
        description="'builtin' (the 109-task suite), 'builtin:N' (its first N; the default, builtin:24: single operators "
        "a 0.9 M-parameter policy on 2 CPU cores learns in minutes), 'dice:PATH' (a DICE JSON file or folder), "
        "'kernelbench:DIR', 'kernelbench-json:PATH' (KernelBench's dataset rows), 'alpaca:PATH' (CuKe / Alpaca pairs) "
        "or 'jsonl:PATH'; several joined by '+' (DICE's two files: dice:INFILL.json+dice:E2E.json); see "
        "dice_ray.tasks.loaders.",
    )
    heldout_fraction: float = Field(
        0.2, ge=0.0, lt=1.0, description="Share of tasks kept out of SFT and RL, for compile-rate reports."
    )
    max_tasks: int | None = Field(None, ge=1, description="Cap on tasks: the first N in load order (train: before the held-out split; eval: after --split).")
    max_input_elements: int | None = Field(
        2**28,
        ge=1,
        description="References whose get_inputs() allocates more elements than this, by a static lower bound "
        "(DICE's data holds references of up to 17 GB of inputs), get their size constant halved until they fit "
        "(KernelBench#146) or are refused when they have none; None: no cap.",
    )
    solution_variants: bool = Field(
        False, description="Keep the tasks' slower honest solution variants (the built-in suite's solution_slow.py) for "
        "the SFT warm start, so that the policy can write either and RL's speedup term can move it to the faster "
        "(GPU; benchmarks/learning.py --speedup-variants). False: the variants are dropped at load.")
    prompt_template: Literal["compact", "dice"] = Field(
        "compact",
        description="Prompt template set: 'compact' fits the tiny policy's ~600-token prompt budget; 'dice' is "
        "DICE-style full prompts (with a worked example) for real SDAR-size models.",
    )


class ModelConfig(_Section):
    """The tiny SDAR-shape block-diffusion policy (Qwen3 architecture, block-causal attention)."""

    hidden_size: int = Field(128, ge=16, description="Transformer width (Qwen3 hidden_size).")
    intermediate_size: int = Field(384, ge=16, description="MLP width (Qwen3 intermediate_size).")
    num_hidden_layers: int = Field(
        2, ge=1, description="2: the SFT warm start reaches its target loss ~2x sooner than with 4 layers (per step "
        "and in steps) on CPU; SDAR-1.7B has 28."
    )
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    head_dim: int = Field(32, ge=8, description="Channels a head.")
    max_position_embeddings: int = Field(4096, ge=128, description="Longest prompt + response (tokens).")
    block_size: int = Field(4, ge=1, description="Tokens per diffusion block (SDAR / DICE: 4).")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter dtype; bf16 matmul is ~85x slower than fp32 on AVX2-only CPUs."
    )
    path: str | None = Field(None, description="Load a saved policy from this folder instead of building one: a "
                             "dice-ray policy folder, an SDAR / LLaDA / Dream checkpoint folder, or a Hugging Face Hub "
                             "id (org/name[@revision]; the local hub cache first, then a download of the config, "
                             "safetensors and tokenizer only).")
    rope_theta: float = Field(10000.0, gt=0.0, description="RoPE base (Qwen3).")
    tie_word_embeddings: bool = Field(True, description="Share the input embedding and the LM head (fewer params).")
    family: Literal["sdar", "llada", "dream"] = Field(
        "sdar",
        description="Diffusion LM family (dice_ray.policy.families): 'sdar' block diffusion (SDAR / TraDo / DICE, "
        "Qwen3 with a block-causal mask), 'llada' (LLaDA: Llama-shaped, fully bidirectional, no logit shift) or "
        "'dream' (Dream: Qwen2-shaped, fully bidirectional, logits shifted by one). LLaDA and Dream sample and infill "
        "over the whole masked response; every family trains with RL and SFT.",
    )

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"model.num_key_value_heads={self.num_key_value_heads} (grouped-query attention)")
        return self


class SamplingConfig(_Section):
    """Block-diffusion decoding (SDAR / Fast-dLLM low-confidence remasking)."""

    max_new_tokens: int = Field(256, ge=4, description="Response length cap (tokens; a multiple of model.block_size). "
                                "The default fits the longest solution of builtin:24 (199 tokens); DICE: 4096.")
    steps_per_block: int = Field(4, ge=1, description="Denoising steps a block for static remasking.")
    remasking: Literal["static", "dynamic"] = Field(
        "dynamic", description="static: k tokens a step; dynamic: every token above the threshold (>=1)."
    )
    threshold: float = Field(0.9, gt=0.0, le=1.0, description="Confidence threshold for dynamic remasking.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int | None = Field(None, ge=1, description="Keep the k most likely tokens when drawing (None: all).")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass (None: off).")
    cuda_graphs: bool = Field(
        True, description="On a GPU, record the block sampler's cached denoising forward as CUDA graphs and replay "
        "them (dice_ray.policy.graphs): the forward is one launch instead of ~1,600 from Python at the SDAR-1.7B "
        "shape; the sampling around it stays eager. Ignored on CPU, without the KV cache and by LLaDA / Dream.")
    max_batch_rows: int = Field(
        128, ge=0, description="SDAR: rows (samples) a rollout worker decodes in one batch. A worker's groups (prompt "
        "x G samples) of a call are packed, G rows each, into batches of up to max(1, this // G) groups, prompts "
        "left-padded to the batch's longest (dice_ray.policy.sampler.sample_groups); each group keeps its own seed, so "
        "its samples do not depend on the batch it shares (up to floating-point rounding). At the SDAR-1.7B shape "
        "decoding is bound by reading the weights: 128 rows cost little more than 8. The KV cache holds every row of "
        "the batch (the dry-run plan counts it). 0 or 1: one group a batch. LLaDA / Dream always decode one group a "
        "batch.")


class SFTConfig(_Section):
    """Masked-diffusion SFT on the suite's reference solutions: the trainer's warm start (plain torch, cached by
    content hash, ``dice_ray.policy.sft_warm_start``) and ``dice-ray sft`` (a one-process DeepSpeed engine, resumable,
    ``dice_ray.policy.sft``)."""

    enabled: bool = Field(True, description="Warm-start the policy by SFT before RL (skipped when model.path is set).")
    steps: int = Field(800, ge=0, description="Optimizer steps at most (see target_loss); sets the cosine schedule.")
    batch_size: int = Field(8, ge=1, description="(prompt, target) pairs a step.")
    learning_rate: float = Field(3e-3, gt=0.0, description="AdamW peak lr (linear warm-up, cosine decay).")
    warmup_steps: int = Field(20, ge=0, description="Linear lr warm-up steps.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Cosine decay floor, as a share of the peak lr.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient-norm clip.")
    complementary_mask: bool = Field(
        True,
        description="Also train the complement of each block's mask (DiffuCoder's coupled sampling): every "
        "response token gets a loss each step, for ~25% more compute.",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads during SFT; None: every core this process may use."
    )
    target_loss: float | None = Field(
        0.08,
        gt=0.0,
        description="Stop early once the loss (EMA over ~20 steps) falls below this (nats a masked token); "
        "None: run all steps. Stopping short of perfect memorization keeps temperature-1 samples diverse, "
        "so RL groups have differing rewards.",
    )
    log_every: int = Field(50, ge=1, description="Record the loss every this many steps (SFTReport.losses).")
    checkpoint_every: int = Field(100, ge=1, description="dice-ray sft: steps between checkpoints (and one at the end).")
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Batches of batch_size whose mean loss makes one optimizer step (effective batch: "
        "batch_size * this); targets and schedule count optimizer steps."
    )
    zero_stage: int = Field(
        0, ge=0, le=2,
        description="dice-ray sft: DeepSpeed ZeRO stage of its one-process engine. 0: no ZeRO (one process has "
        "nothing to partition; in float32 the weights equal the trainer's warm start's bit for bit); 1-2: "
        "ZeRO's optimizer and gradient buckets. bf16 keeps fp32 master weights at every stage. The trainer's "
        "warm start ignores it (plain torch).",
    )
    cache_dir: str = Field("~/.cache/dice-ray/sft", description="Where warm-started weights are cached.")
    seed: int | None = Field(
        None, ge=0, lt=2**32, description="Seed of the warm start's data order and masks; None: rl.seed. Fix it to run "
        "several RL seeds from one warm start (benchmarks/learning.py).")


class RewardConfig(_Section):
    """Reward of one verdict (see ``dice_ray.verify.reward``).

    0 unless compiled, correct (when measured) and no anti-cheat rule broken; then
    ``correct_reward + speedup_weight * clip(log2(speedup), -speedup_clip_low, speedup_clip_high)``.
    With no GPU (compile-only mode) correctness is unmeasured and a compiled, rule-abiding candidate
    gets ``compile_only_reward``.
    """

    correct_reward: float = Field(1.0, description="Reward of a compiled, correct candidate that broke no rule.")
    speedup_weight: float = Field(0.5, description="Weight of clip(log2(speedup)) added to correct_reward.")
    speedup_clip_low: float = Field(1.0, ge=0.0, description="log2(speedup) is clipped below at -this.")
    speedup_clip_high: float = Field(3.0, ge=0.0, description="log2(speedup) is clipped above at this.")
    compile_only_reward: float = Field(1.0, description="Reward of an ok verdict from a compile-only verifier (no GPU: nothing timed).")


class VerifyConfig(_Section):
    """The verifier: compile, static anti-cheat rules, sandboxed run, correctness and timing.

    Correctness and timing follow KernelBench (``eval.py``, ``timing.py``: seeded ``Model`` and
    ``ModelNew``, several input trials, allclose, CUDA-event timing with an L2 flush) and close its
    known gaps (see ``dice_ray.verify``'s docstring and ``dice_ray.verify.rules.catalog.RULES``).
    """

    mode: Literal["auto", "gpu", "compile_only"] = Field(
        "auto", description="auto: gpu when the actor has one, else compile_only."
    )
    correctness_trials: int = Field(3, ge=1, description="Input sets (different seeds) checked against the reference.")
    timing_trials: int = Field(
        20, ge=1, description="Timed windows of each of reference and candidate (median taken; fewer, at least 3, "
        "when they would not fit in run_timeout_s).")
    warmup: int = Field(3, ge=0, description="Untimed forwards before timing.")
    rtol: float = Field(1e-2, gt=0.0, description="Relative tolerance for fp32 outputs (KernelBench: 1e-2).")
    atol: float = Field(
        1e-2, ge=0.0,
        description="Absolute tolerance for fp32 outputs (KernelBench: 1e-2); capped at rtol * rms(reference) "
        "so near-zero outputs are compared relatively and all-zeros cannot pass.",
    )
    half_rtol: float = Field(5e-2, gt=0.0, description="Relative tolerance when the reference output is fp16/bf16.")
    half_atol: float = Field(5e-2, ge=0.0, description="Absolute tolerance when the reference output is fp16/bf16.")
    seed: int = Field(42, ge=0, lt=2**32, description="Seed of Model/ModelNew construction (KernelBench: 42).")
    input_seed: int | None = Field(
        None, ge=0, lt=2**31,
        description="Base seed of the inputs (trial i: input_seed+1+i; timed call j: input_seed+1000+j). None: each "
        "Verifier draws a secret one at random, so no candidate can compute its answers ahead from a known seed (a "
        "known seed was a measured cheat: outputs precomputed in __init__, looked up by the kernel); set it only to "
        "reproduce a verdict.")
    compile_timeout_s: float = Field(60.0, gt=0.0, description="Limit on executing the candidate module (NVRTC compiles).")
    run_timeout_s: float = Field(60.0, gt=0.0, description="Limit on each later stage: reference check, then run + timing.")
    start_timeout_s: float = Field(180.0, gt=0.0, description="Limit on starting a sandbox worker (import torch, CUDA init).")
    arch: str = Field("sm_90", pattern=r"^(sm|compute)_\d{2,3}[af]?$",
                      description="NVRTC target when no GPU is present (compile-only mode): sm_NN or compute_NN, "
                      "optionally with a or f (sm_90a).")
    static_rules: bool = Field(
        True, description="Apply the static anti-cheat rules and the candidate's import guard. False only to test the sandbox."
    )
    dry_run: bool = Field(
        True, description="compile_only: also run ModelNew.forward on meta tensors with kernel launches checked, not run."
    )
    max_jobs_per_worker: int = Field(500, ge=1, description="Respawn the sandbox worker after this many candidates.")
    workers: int = Field(
        0, ge=0, le=64,
        description="Sandbox worker processes of one verifier (0: auto, 6 on a GPU, 1 compile-only): candidates load, "
        "compile and check in parallel; timing takes the GPU one worker at a time.",
    )
    spare_workers: int | None = Field(
        None, ge=0, le=64,
        description="Spare sandbox workers kept ready to replace one after a crash, so a crash costs a swap, not a "
        "start. None (auto): as many as a quarter of the verifier's GPU memory holds at 1 GiB each, at most 32 (31 on "
        "an H200), fewer where a worker would be left under 1 GiB. Each spare's 1 GiB (its CUDA context and kernels, ~0.5 GiB, and room for a crashed worker's memory "
        "while it waits, stopped, for the verifier's idle time to be killed: its exit stalls other workers' "
        "allocations) comes out of gpu_memory_fraction, before the workers' caps. On a GPU spares are forked with the "
        "verifier, and each does its CUDA set-up (which holds the GPU gate) only once no candidate has been in "
        "verification for 0.5 s (between RL steps), at most 4 at once (the driver makes contexts one at a time: 28 at "
        "once held the gate in parts of up to ~6 s, 4 at once in parts under 0.7 s); a crash that finds none ready starts one at once, holding up "
        "timing stages (not the others) for ~2 s in parts: a batch with more crashes than spares costs ~0.7 s for "
        "each beyond them on an H200. Compile-only verifiers keep at most 2, started at the first replacement.",
    )
    fork_server: bool = Field(
        True, description="Fork replacement workers from a process with torch imported (~1 s) instead of a cold start (~8 s)."
    )
    cpu_address_space_gib: float = Field(
        16.0, ge=0.0, description="RLIMIT_AS of a compile-only worker (GiB; 0: none). Not set on GPU: CUDA reserves huge ranges."
    )
    file_size_mib: float = Field(64.0, gt=0.0, description="RLIMIT_FSIZE of the worker (MiB): largest file it may write.")
    gpu_memory_fraction: float = Field(
        0.9, gt=0.0, le=1.0,
        description="Share of the GPU's memory a verifier may take: its spares' rooms (spare_workers x 1 GiB), then "
        "its workers' caps, each an equal part of the rest (torch.cuda.set_per_process_memory_fraction), so one "
        "candidate cannot starve the others. An explicit spare_workers whose rooms would leave a worker under 1 GiB "
        "is an error when the verifier starts; auto keeps fewer spares instead (none on a GPU that small).",
    )
    seccomp: bool = Field(
        True, description="Refuse new processes, exec and sockets of every family in the worker once its set-up is done: "
        "a seccomp filter through libseccomp (dice_ray.verify.sandbox.confine). Without libseccomp.so.2 it is not applied, and "
        "the worker says so (Verifier.stats()['confinement'], one log line).")
    landlock: bool = Field(
        True, description="Confine the worker with Landlock from its start: files read only below Python's, the system "
        "libraries', the CUDA toolkit's and driver's folders (and sandbox_read_paths), written only in its private "
        "folder; TCP and signals to other processes refused (dice_ray.verify.sandbox.confine). A kernel without Landlock "
        "(before Linux 5.13, or not in its lsm= list) leaves it off, and the worker says so; a worker whose imports or "
        "CUDA set-up fail under it turns it off for the verifier's later workers (logged once).")
    sandbox_read_paths: list[str] = Field(
        default_factory=list, description="More folders or files the worker may read under Landlock: a CUDA "
        "toolkit or driver outside /usr and $CUDA_HOME, a Python package outside sys.path. The inline build cache is "
        "added on a GPU.")
    preload_kernels: bool = Field(
        True, description="A GPU worker loads the kernels every job uses (a CUDA graph captured and dropped) in its "
        "start-up, which holds the GPU gate shared like the rest of its CUDA set-up, so its first jobs do not load them "
        "(dice_ray.verify.sandbox.kernel_preload). It changes speed, never a verdict (a failed capture is reported in the "
        "worker's info and its kernels load on first use); no effect without a GPU. Measured with crashes in the mix "
        "(one H200, --rounds 3, medians): 14.99 candidates/s with it against 13.33 without, side by side in one device "
        "call (a spare's start then held the GPU gate 27 ms instead of 254 ms)."
    )
    # -- timing (dice_ray.verify.trials.timing_stage) --
    input_pool_mib: float = Field(
        1024.0, gt=0.0,
        description="GPU memory (MiB) for the rotating pool of timing inputs; a pool slot reused is refilled with "
        "fresh values first, so every timed call sees new data at a new or refreshed address.",
    )
    timing_window_ms: float = Field(
        0.125, ge=0.0,
        description="Least GPU time (ms) in one timed window: calls shorter than this are timed k..2k-1 to a window, "
        "k = ceil(timing_window_ms / that side's call time) for the reference and the candidate each, each window's "
        "size drawn in secret and each call on fresh inputs, so the event timestamps' resolution (~1 us) is a small "
        "share; 0: one call a window. Windows end at a stream-ordered event, so the host's wake-up jitter is not timed "
        "and a short window suffices; each call costs the host its launch time (10-12 us for a dice_ray.launch kernel, "
        "more for a module of many ops), spent while the timing stage holds the GPU alone. Measured on one H200 against "
        "0.25 (the default until 2026-12-01), with the faster launch, in one device call: the timing stage 46.5 against "
        "64.0 ms a correct candidate, the crash mix 19.7-20.8 against 18.6-19.0 candidates/s, speedup CoV <= 0.49 %, "
        "speedups 0.7 % apart at the median (at most 4.9 %). The price: side-stream work ending within the 5-10 us "
        "outlast margin goes untimed, up to 8 % of a 0.125 ms window against 4 % of a 0.25 ms one (more of the shorter "
        "windows of calls under ~2 us: k is capped at 64); the static rules refuse side streams before that.",
    )
    output_checks: int = Field(
        5, ge=1, description="Outputs over 64 MiB: timed calls (drawn in secret, plus the last) whose outputs are checked; "
        "for smaller outputs, the last call of every timed window and 64 calls drawn in secret are checked."
    )
    audit_speedup: float = Field(
        10.0, gt=1.0, description="Speedups above this are re-timed with the host wall clock (the audit)."
    )
    audit_factor: float = Field(
        3.0, gt=1.0,
        description="The audit fails (cheat, rule timing-audit) when the CUDA-event speedup exceeds the wall-clock "
        "speedup by more than this factor.",
    )
    compile_baseline: bool = Field(
        False,
        description="Also time torch.compile(reference) alongside (reported as speedup_compiled, not rewarded). "
        "Inductor runs compilers as subprocesses and writes outside the worker's folder, so this needs seccomp=false "
        "and landlock=false.",
    )
    # -- correctness (dice_ray.verify.trials.correctness_trials, dice_ray.verify.trials.correctness) --
    scaled_trial: float = Field(
        4.0, gt=0.0,
        description="The last correctness trial multiplies floating inputs by this (another scale; 1: off).",
    )
    shape_trial: bool = Field(
        True, description="One more trial with a size constant of get_inputs doubled (catches hard-coded shapes)."
    )
    precision_rtol: float = Field(
        1e-4, ge=0.0,
        description="fp32 outputs: relative RMS error against a float64 run of the reference may not exceed "
        "max(this, 10 x the fp32 reference's own); catches precision downgrades (0: off).",
    )
    # -- load_inline format (dice_ray.verify.candidate.inline_spec) --
    allow_vendor_libraries: bool = Field(
        False,
        description="load_inline format only: accept vendor math libraries (cuBLAS/cuBLASLt, cuDNN, cuSPARSE, cuFFT, "
        "cuSOLVER, cuRAND calls and headers, header-only CUTLASS/CuTe/thrust, torch's getCurrentCUDABlasHandle) "
        "instead of the cheat rule cuda-library; extra_ldflags may then name -lcublas, -lcublasLt, -lcudnn, "
        "-lcusparse, -lcufft, -lcusolver, -lcurand (a closed list: any other flag stays refused), and the build "
        "links the libraries the sources use. Speedups then measure the vendor library, not the model's kernel. "
        "Every timed call must still launch at least one __global__ kernel of the candidate's own extension "
        "(no-kernel-launch: the launches cuBLAS makes are not counted). NCCL/NVSHMEM and torch's compute "
        "(at::matmul, at::cuda::blas::*) stay refused. The fast (NVRTC) format compiles device code only and cannot "
        "call host libraries: it keeps the cuda-library rule.",
    )
    inline_cache_dir: str | None = Field(
        None, description="Build cache of load_inline candidates (None: $DICE_RAY_INLINE_CACHE or "
        "~/.cache/dice-ray/inline); shared by the verifiers of one machine."
    )
    inline_max_builds: int = Field(
        0, ge=0, le=64, description="load_inline specs compiled at once (each runs g++ and nvcc side by side); "
        "0: half the CPU cores."
    )
    inline_build_timeout_s: float = Field(
        300.0, gt=0.0, description="Wall-clock limit of one compiler process of a load_inline build (s)."
    )
    inline_build_cpu_s: float = Field(600.0, gt=0.0, description="RLIMIT_CPU of one compiler process (s).")
    inline_build_memory_gib: float = Field(
        8.0, gt=0.0, description="RLIMIT_AS of one compiler process (GiB; nvcc on torch's headers peaks near 3)."
    )
    inline_build_file_mib: float = Field(512.0, gt=0.0, description="RLIMIT_FSIZE of one compiler process (MiB).")
    inline_lite_headers: bool = Field(
        True, description="Compile the CUDA file with a light torch header first (~5x faster; the full headers "
        "when it lacks a name)."
    )
    inline_pch: bool = Field(
        True, description="Precompile torch/extension.h once per toolchain for the bindings file (~0.75 GB on disk)."
    )
    inline_host_opt: Literal["-O0", "-O1", "-O2", "-O3"] = Field(
        "-O1", description="Optimisation of load_inline host code (device code is always -O3)."
    )

    @model_validator(mode="after")
    def _check_baseline(self) -> "VerifyConfig":
        if self.compile_baseline and (self.seccomp or self.landlock):
            raise ValueError("verify.compile_baseline=true needs verify.seccomp=false and verify.landlock=false: "
                             "torch.compile's inductor runs the compiler as a subprocess, which the worker's seccomp "
                             "filter forbids, and Landlock confines what it may read and write")
        return self


class PhaseConfig(_Section):
    """BiC-RL curriculum (DICE): infilling first, end-to-end after, a ramp between (no abrupt switch); see
    ``dice_ray.cluster.scheduler``."""

    schedule: Literal["gated", "fixed"] = Field(
        "gated", description="gated: leave infilling when gate_metric over the last gate_window infilling steps reaches "
        "gate_threshold (or at infill_steps), and hold or raise infilling again when the end-to-end reward collapses "
        "(collapse_ratio); fixed: infill_steps of infilling, then the ramp (DICE's step counts).")
    infill_steps: int = Field(8, ge=0, description="fixed: steps of infilling (DICE: 20); gated: the most (the gate may "
                              "open sooner).")
    ramp_steps: int = Field(4, ge=0, description="Steps over which the infill fraction falls linearly to final.")
    final_infill_fraction: float = Field(0.25, ge=0.0, le=1.0, description="Infill share of prompts after the ramp "
                                         "(DICE: 0; some infilling keeps the tiny policy from forgetting it).")
    gate_metric: Literal["auto", "compile_rate", "correct_rate", "reward_mean"] = Field(
        "auto", description="gated: the figure of the infilling prompts that opens the gate; auto: the correct rate "
                            "when the verifier measures it (GPU), else the compile rate.")
    gate_threshold: float = Field(0.7, ge=0.0, le=1.0, description="gated: leave infilling once gate_metric (mean over "
                                  "gate_window steps) is at least this.")
    gate_window: int = Field(2, ge=1, description="gated: steps averaged by the gate and by the collapse check.")
    collapse_ratio: float = Field(
        0.5, ge=0.0, lt=1.0, description="gated: when the end-to-end reward (mean over gate_window steps) falls below "
        "this share of its best such mean so far, the infill fraction goes back up one ramp step and holds until the "
        "reward recovers (DICE: a transition too abrupt makes the model forget); 0: off.")
    scaffold_granularity: Literal["source", "body"] = Field(
        "source", description="Where infill scaffolds are cut: 'source' (DICE's: the whole CUDA source is the middle) or "
        "'body' (the first __global__ kernel's body; signature, braces and the rest kept). The SFT warm start learns the same cut.",
    )


class RLConfig(_Section):
    """GRPO-family loss with TraceRL log-probs (Wang et al. 2025, DICE's method); names after TRL's GRPOConfig."""

    steps: int = Field(30, ge=1, description="RL steps in the run (DICE: 20 infilling + 100 end-to-end).")
    update_policy: bool = Field(
        True, description="False: the control arm of benchmarks/learning.py: the same sampling, verification and "
        "curriculum, but no learner step, so the policy never changes.")
    prompts_per_step: int = Field(8, ge=1, description="Prompts (groups) a step (DICE: 64).")
    num_generations: int = Field(8, ge=2, description="G: samples a prompt, a group (DICE: 16).")
    learning_rate: float = Field(2e-4, gt=0.0, description="AdamW lr (DICE: 1e-6 on 8B). The tiny default policy "
                                 "learns at 2e-4; 3e-4 with two PPO epochs forgets (benchmarks/learning.py).")
    beta: float = Field(0.0, ge=0.0, description="k3 KL coefficient against the reference policy (DICE: 0.01).")
    epsilon: float = Field(0.2, gt=0.0, description="PPO clip range.")
    scale_rewards: bool = Field(True, description="Divide group-centred rewards by the group std (GRPO z-score).")
    drop_flat_groups: bool = Field(
        True, description="Drop a group whose rewards are all equal (no advantage signal; DICE drops them). False "
        "keeps it with advantage 0: it still adds the KL term's gradient (rl.beta > 0), and a step whose groups are "
        "all flat still runs the learner (how a random-init policy's learner step is measured: docs/training.md).")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient-norm clip of the RL update.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over a step's groups (PPO epochs).")
    logprob_estimator: Literal["tracerl", "coupled", "diffu_grpo"] = Field(
        "tracerl",
        description="Per-token log-prob estimator of the RL loss (dice_ray.policy.logprobs). 'tracerl' (TraceRL, "
        "Wang et al. 2025; DICE's): each token scored in the denoising state the sampler drew it in, the ratio "
        "against the sampler's log-probs. 'coupled' (DiffuCoder's coupled-GRPO, Gong et al. 2025, arXiv "
        "2506.20639): a seeded random mask (ratio ~ U(0.2, 0.8)) within each block and its complement, two "
        "passes, each token scored where it is masked. 'diffu_grpo' (d1, Zhao et al. 2025, arXiv 2504.12216): "
        "one pass with the whole response masked. The last two recompute the old log-probs at the start of "
        "each step (pre-update weights, same masks).",
    )
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of sampling, data order, the learner and the SFT warm start "
                      "(each rollout's is seed * 1,000,003 + step * 1000 + prompt: within torch's 64 bits).")
    max_staleness: int = Field(
        0, ge=0,
        description="Asynchronous pipeline (dice_ray.cluster.pipeline): rollout and verification run up to this many "
        "steps ahead of the learner, so a step's samples may come from weights up to this many learner steps old "
        "(checked on every group). 0: synchronous (draw, sample, verify, learn, sync). Stale samples keep their "
        "behaviour log-probs: 'tracerl' uses them in the ratio; 'coupled' and 'diffu_grpo' recompute the old "
        "log-probs under the current weights, so their ratio ignores the lag (a warning says so). Through the "
        "object store the weight push is queued behind the rollouts ahead and the rollout workers form lanes "
        "(cluster.num_rollout_workers).",
    )


class EvalConfig(_Section):
    """Evaluations at the start and the end of a run: the reward on fixed training prompts (does the RL teach?) and
    compile / correct rates on held-out tasks (does it carry over?)."""

    heldout_tasks: int = Field(6, ge=0, description="Held-out tasks sampled (0: skip the report).")
    train_tasks: int = Field(12, ge=0, description="Training tasks of each phase whose prompts are sampled at the start "
                             "and the end with fixed seeds: the reward on training prompts the summary compares (0: skip).")
    samples: int = Field(4, ge=1, description="Samples a training task and phase in the evaluation of training prompts.")
    heldout_samples: int = Field(
        16, ge=1, description="Samples a held-out task and phase: the held-out tasks are few and their compile rate "
        "small, so more samples keep it from moving by chance (4 tasks x 4 samples a phase moved a 0.22 rate by up to "
        "0.12 between seeds of one policy).")


class ClusterConfig(_Section):
    """Ray resources and the DeepSpeed learner."""

    address: str | None = Field(None, description="Ray address; None: RAY_ADDRESS or a new private local cluster (a "
                                      "`ray start` cluster on the machine is not joined; 'auto' joins it).")
    num_rollout_workers: int = Field(
        1, ge=1, description="RolloutWorker actors. Synchronous (or broadcast sync): each step's prompts are dealt "
        "over all of them. Asynchronous through the object store: they form min(workers, rl.max_staleness + 1) "
        "lanes and consecutive steps sample side by side on different lanes (dice_ray.cluster.pipeline).",
    )
    num_verifiers: int | None = Field(None, ge=1, description="None: one per GPU, or 2 CPU actors without GPUs.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage of the learner.")
    learner_gpus: float = Field(0.0, ge=0.0, description="GPUs for the learner actor (0: CPU, gloo; a fraction shares one).")
    rollout_gpus: float = Field(0.0, ge=0.0, description="GPUs a rollout worker asks Ray for (0: CPU).")
    verifier_gpus: float = Field(1.0, ge=0.0, description="GPUs per verifier actor when GPUs exist.")
    # -- placement of the roles (dice_ray.cluster.placement) --
    placement: Literal["pack", "spread"] = Field(
        "pack", description="How the rollout workers and the verifiers spread over the cluster's nodes "
        "(dice_ray.cluster.placement). pack: on as few nodes as hold them (Ray's PACK: the rollout workers' placement "
        "group, a bundle of rollout_gpus and 1 CPU a worker; a group of one bundle a GPU verifier). spread: over as "
        "many nodes as hold them (the rollout workers' group is Ray's SPREAD; verifiers take Ray's SPREAD actor "
        "scheduling, since a group's lone bundle lands by best fit under every strategy). The learner's ranks are "
        "always one PACK group, a bundle of learner_gpus a rank, reserved first. Without a GPU in the cluster no role "
        "asks for a group.",
    )
    placement_timeout_s: float = Field(
        900.0, gt=0.0, description="Seconds to wait for a role's placement group (an autoscaling cluster may add "
        "nodes meanwhile); then the run stops, naming the role, its bundles, the strategy and the cluster's "
        "resources (a verifier that cannot be placed fails its slot with that message instead).",
    )
    colocate_rollout: bool = Field(
        False, description="Put the rollout workers on the learner ranks' GPUs: worker i in rank (i mod "
        "learner_ranks)'s bundle with rollout_gpus of it (the rank keeps learner_gpus less its workers' shares), "
        "and free the learner's GPU memory while they sample: after each learner step (and after start-up) its "
        "weights, gradients, optimizer states and KL reference go to CPU memory (DeepSpeed's offload_states for "
        "what it manages, ZeRO 1-3; torch for the rest) and come back before the next step; the rollout workers "
        "empty their CUDA cache after sampling. A GPU holds one phase at a time (dice-ray train --dry-run counts it "
        "so). Needs GPUs (learner_gpus <= 1 and rollout_gpus > 0, the workers of a bundle leaving the rank a "
        "share), rl.max_staleness=0 (nothing samples while the learner learns) and, at zero_stage 0, "
        "model.dtype=float32. No effect without a GPU in the cluster.",
    )
    # -- the learner's ranks and the weight sync (dice_ray.cluster.learner, dice_ray.cluster.weight_sync) --
    learner_ranks: int = Field(
        1, ge=1, description="Data-parallel DeepSpeed ranks of the learner (Ray actors; on GPUs one placement "
        "group, learner_gpus a rank). N ranks take the same update as one on the same groups.",
    )
    micro_batch_tokens: int = Field(
        8192, ge=0, description="Token budget of a learner micro-batch (groups packed first-fit, a group counts "
        "G * (prompt + response) tokens and is never split; one over the budget goes alone). 0: one group a "
        "micro-batch. Micro-batches accumulate gradients into one optimizer step.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each group's forward in the backward pass (torch.utils.checkpoint a "
        "group): activation memory of one group instead of a micro-batch, for ~1.3x learner compute.",
    )
    learner_rows_per_chunk: int = Field(
        0, ge=0, description="Samples (rows) of a group the learner scores in one forward + backward: a group of G "
        "samples goes in ceil(G / learner_rows_per_chunk) row chunks, gradients accumulated, one optimizer step a "
        "step as before; each chunk re-encodes the prompt (its cost: one prompt pass a chunk). The loss is the "
        "whole group's exactly (each chunk's per-sequence means divided by G; advantages come from the whole "
        "group). The learner's activations are then those of a chunk, not of a group: what lets DICE's 16 samples "
        "x 4096 tokens fit (dice-ray train --dry-run shows it). 0 (default): the whole group in one pass.",
    )
    fused_kernels: Literal["auto", "none", "liger"] = Field(
        "auto", description="Fused Triton kernels in the learner's model (dice_ray.policy.fused): Liger-Kernel's "
        "SwiGLU MLP and RoPE (Hsu et al. 2024, arXiv 2410.10989; RMSNorm is torch's fused kernel in every model), same weights and numerics within bf16 "
        "rounding. auto (default): Liger when the learner is on CUDA and liger-kernel imports, otherwise off (the "
        "learner line says why on a GPU; CPU learners always run without it); liger: required, the run stops at "
        "start-up when it cannot be applied (needs learner_gpus > 0 and the gpu extra: pip install -e '.[gpu]'); "
        "none: off.",
    )
    learner_attention: Literal["sdpa", "flex", "auto"] = Field(
        "sdpa", description="Attention of the learner's block-masked passes (dice_ray.policy.model.set_attention). "
        "sdpa (default): torch's scaled_dot_product_attention over the dense boolean block mask, every query-key "
        "pair computed. flex: FlexAttention (torch.nn.attention.flex_attention) over a BlockMask built from the same "
        "mask, which skips the fully masked 128 x 128 tiles (about half of a TraceRL pass's pairs); the same numbers "
        "within bf16 rounding; compiled by torch.compile on first use (a compile failure falls back to sdpa with one "
        "line on stderr). Needs a GPU learner (PyTorch has no FlexAttention backward on CPU). auto: flex on a GPU "
        "learner, sdpa on CPU.",
    )
    learner_compile: bool = Field(
        False, description="torch.compile the learner's decoder layers and log-prob head (dice_ray.policy.compiled): "
        "two compiled regions a layer around the KV-cache update, fused elementwise kernels and far fewer launches "
        "from Python an update. Compiles at the first step (about a minute on a GPU; once more when a second shape "
        "comes, then lengths are symbolic); a compile failure runs the same code eagerly with one line on stderr. "
        "Not with zero_stage 3 (its parameter hooks run inside the layers).",
    )
    learner_offload: bool = Field(
        False, description="DeepSpeed ZeRO-Offload: optimizer state in CPU memory (ZeRO-3: parameters too) all "
        "the time, the optimizer stepping on the CPU. Needs zero_stage >= 1. colocate_rollout instead moves the "
        "states to CPU memory only while rollouts sample.",
    )
    weight_sync: Literal["auto", "broadcast", "object_store"] = Field(
        "auto", description="How weights reach rollout workers after a learner step. auto: bucketed NCCL "
        "broadcast when the learner and rollout workers hold whole GPUs of their own, else the object store. "
        "broadcast: the bucketed broadcast (NCCL on separate GPUs, else gloo). object_store: a CPU state dict "
        "through Ray's object store.",
    )
    weight_sync_bucket_mb: float = Field(
        256.0, gt=0.0, description="Bucket size of the weight broadcast (MiB of flattened tensors a collective).",
    )
    # -- verifier pool autoscaling (dice_ray.cluster.verifier_pool) --
    verifier_autoscale: bool = Field(
        False, description="Resize the verifier pool by queue depth between min_verifiers and max_verifiers."
    )
    min_verifiers: int = Field(1, ge=1, description="Autoscaling floor (verifier actors).")
    max_verifiers: int | None = Field(
        None, ge=1,
        description="Autoscaling ceiling (verifier actors); None: as many as the cluster's GPUs hold for GPU "
        "verifiers, else the starting size.",
    )
    verifier_target_queue: float = Field(
        4.0, gt=0.0,
        description="Autoscaling target: candidates waiting per serving verifier actor; a deeper queue grows the pool.",
    )
    verifier_scale_cooldown_s: float = Field(
        30.0, ge=0.0,
        description="Seconds between two autoscaling changes; shrinking also needs the pool to have been "
        "larger than needed for this long (draining actors finish their in-flight candidates).",
    )

    @property
    def colocated_rollouts_per_rank(self) -> int:
        """With ``colocate_rollout``: rollout workers in a learner rank's bundle at most (workers dealt round the
        ranks: ``ceil(num_rollout_workers / learner_ranks)``)."""
        return -(-self.num_rollout_workers // self.learner_ranks)

    @property
    def colocated_learner_share(self) -> float:
        """With ``colocate_rollout``: the GPUs a learner rank asks of its bundle, ``learner_gpus`` less its rollout
        workers' ``rollout_gpus`` each, rounded down to Ray's 1e-4 resolution (so the shares never sum above the
        bundle)."""
        rest = self.learner_gpus - self.colocated_rollouts_per_rank * self.rollout_gpus
        return math.floor(rest * 10_000 + 1e-6) / 10_000

    @model_validator(mode="after")
    def _check_colocation(self) -> ClusterConfig:
        if not self.colocate_rollout:
            return self
        if not (self.learner_gpus > 0 and self.rollout_gpus > 0):
            raise ValueError(f"cluster.colocate_rollout=true needs cluster.learner_gpus > 0 and cluster.rollout_gpus > 0 "
                             f"(the rollout workers share the learner ranks' GPUs), got learner_gpus={self.learner_gpus:g} "
                             f"and rollout_gpus={self.rollout_gpus:g}")
        if self.learner_gpus > 1:
            raise ValueError(f"cluster.colocate_rollout=true needs cluster.learner_gpus <= 1, got {self.learner_gpus:g}: "
                             "a rank's bundle is the one GPU it shares with its rollout workers (Ray grants fractions "
                             "of one GPU only)")
        k = self.colocated_rollouts_per_rank
        if self.colocated_learner_share <= 0:
            raise ValueError(f"cluster.colocate_rollout=true: {k} rollout worker(s) a learner bundle (ceil of "
                             f"cluster.num_rollout_workers={self.num_rollout_workers} / cluster.learner_ranks="
                             f"{self.learner_ranks}) x cluster.rollout_gpus={self.rollout_gpus:g} = "
                             f"{k * self.rollout_gpus:g} must stay below cluster.learner_gpus={self.learner_gpus:g} "
                             "(the rank keeps the rest of its bundle): lower rollout_gpus or num_rollout_workers")
        return self

    @model_validator(mode="after")
    def _check_fused_kernels(self) -> ClusterConfig:
        if self.fused_kernels == "liger" and not self.learner_gpus:
            raise ValueError("cluster.fused_kernels='liger' needs a GPU learner, but cluster.learner_gpus is 0 (a CPU "
                             "learner; Liger's Triton kernels run on CUDA only): set learner_gpus > 0, or fused_kernels "
                             "to 'auto' or 'none'")
        return self

    @model_validator(mode="after")
    def _check_learner_speedups(self) -> ClusterConfig:
        if self.learner_attention == "flex" and not self.learner_gpus:
            raise ValueError("cluster.learner_attention='flex' needs a GPU learner, but cluster.learner_gpus is 0 (a CPU "
                             "learner; PyTorch's FlexAttention has no backward on CPU): set learner_gpus > 0, or "
                             "learner_attention to 'auto' or 'sdpa'")
        if self.learner_compile and self.zero_stage == 3:
            raise ValueError("cluster.learner_compile=true does not work with cluster.zero_stage=3 (ZeRO-3 gathers "
                             "parameters in module hooks inside the compiled layers): use zero_stage <= 2, or "
                             "learner_compile=false")
        return self

    @model_validator(mode="after")
    def _check_verifier_bounds(self) -> ClusterConfig:
        if self.learner_offload and self.zero_stage == 0:
            raise ValueError("cluster.learner_offload needs cluster.zero_stage >= 1 (ZeRO-Offload)")
        if self.max_verifiers is not None and self.max_verifiers < self.min_verifiers:
            raise ValueError(
                f"cluster.max_verifiers={self.max_verifiers} must be >= cluster.min_verifiers={self.min_verifiers}"
            )
        n = self.num_verifiers
        if self.verifier_autoscale and n is not None:
            hi = self.max_verifiers if self.max_verifiers is not None else n
            if not self.min_verifiers <= n <= hi:
                raise ValueError(
                    f"cluster.num_verifiers={n} must lie within [cluster.min_verifiers={self.min_verifiers}, "
                    f"cluster.max_verifiers={self.max_verifiers}] when cluster.verifier_autoscale is on"
                )
        return self


class DiceConfig(_Section):
    """Top-level config of ``dice-ray train``."""

    run_dir: str = Field("runs", description="Parent folder of run directories.")
    run_name: str | None = Field(None, description="Run folder name under run_dir (None: a timestamp); one folder name, "
                                 "no path separators (it names the run in storage_path too). A folder that holds a run is refused: "
                                 "dice-ray train --resume continues that run.")
    checkpoint_every: int = Field(1, ge=1, description="RL steps between checkpoints of dice-ray train.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept (oldest deleted first).")
    storage_path: str | None = Field(
        None,
        description="Where checkpoints persist, as Ray Train's storage_path: a folder or an fsspec URL "
        "(s3://bucket/runs, gs://bucket/runs, file:///abs/path, memory://x; s3/gs need s3fs/gcsfs). "
        "Each checkpoint is staged in RUN_DIR/checkpoints, then copied to STORAGE_PATH/RUN_NAME/step_NNNNNN; "
        "keep_checkpoints applies there and only the newest stays staged. None: RUN_DIR/checkpoints only.",
    )
    tasks: TasksConfig = TasksConfig()
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    sft: SFTConfig = SFTConfig()
    reward: RewardConfig = RewardConfig()
    verify: VerifyConfig = VerifyConfig()
    phase: PhaseConfig = PhaseConfig()
    rl: RLConfig = RLConfig()
    eval: EvalConfig = EvalConfig()
    cluster: ClusterConfig = ClusterConfig()

    @property
    def sft_seed(self) -> int:
        """The warm start's seed: ``sft.seed``, else ``rl.seed``."""
        return self.rl.seed if self.sft.seed is None else self.sft.seed

    @field_validator("run_name")
    @classmethod
    def _one_folder_name(cls, name: str | None) -> str | None:
        if name is not None and (name in ("", ".", "..") or any(c in name for c in "/\\\x00")):
            raise ValueError(f"run_name={name!r} must be one folder name: not empty, '.' or '..', no '/', '\\' or NUL")
        return name

    @model_validator(mode="after")
    def _check(self) -> "DiceConfig":
        if self.storage_path is not None:
            from dice_ray.cluster.storage import check_storage_url

            check_storage_url(self.storage_path)
        c = self.cluster
        if c.colocate_rollout and self.rl.max_staleness:
            raise ValueError(f"cluster.colocate_rollout=true needs rl.max_staleness=0, got {self.rl.max_staleness}: the "
                             "learner's states leave its GPU while the rollout workers sample there, so nothing may "
                             "sample while it learns (or set colocate_rollout=false)")
        if c.colocate_rollout and c.zero_stage == 0 and self.model.dtype != "float32":
            raise ValueError(f"cluster.colocate_rollout=true with cluster.zero_stage=0 needs model.dtype=float32, got "
                             f"{self.model.dtype}: DeepSpeed's 16-bit optimizer without ZeRO keeps master copies it "
                             "cannot offload; use cluster.zero_stage >= 1")
        if self.sampling.max_new_tokens % self.model.block_size:
            raise ValueError(
                f"sampling.max_new_tokens={self.sampling.max_new_tokens} must be a multiple of "
                f"model.block_size={self.model.block_size}"
            )
        return self


def _set_dotted(tree: dict[str, Any], key: str, value: Any, item: str) -> None:
    parts = key.split(".")
    if not all(p.strip() for p in parts):
        raise ValueError(f"override {item!r}: the key {key!r} has an empty part; expected dotted.key=value")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {item!r}: {p!r} is not a section")
    node[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}",
                        key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _yaml_error(where: str, e: yaml.YAMLError) -> ValueError:
    """One line naming ``where`` and the line / column of a YAML error."""
    mark = getattr(e, "problem_mark", None)
    at = f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return ValueError(f"{where}:{at} not valid YAML: {problem}" + (f" ({context})" if context else ""))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> DiceConfig:
    """Build a :class:`DiceConfig` from an optional YAML file and ``key=value`` overrides.

    Values in overrides are parsed as YAML scalars (``rl.steps=3``, ``cluster.address=null``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a regular file, is not UTF-8, is not valid YAML (the message
            names the file, line and column), repeats a key or is not a mapping; an override is
            not of the form ``dotted.key=value`` or its value is not valid YAML.
        pydantic.ValidationError: an unknown key or a bad value (the message names it).
    """
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"config {path}: no such file")
        if not p.is_file():
            raise ValueError(f"config {path}: not a regular file")
        try:
            text = p.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ValueError(f"config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        try:
            loaded = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise _yaml_error(f"config {path}", e) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config {path}: top level must be a mapping, got {type(loaded).__name__}")
        tree = loaded
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected dotted.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise _yaml_error(f"override {item!r}", e) from None
        _set_dotted(tree, key.strip(), value, item)
    return DiceConfig.model_validate(tree)
