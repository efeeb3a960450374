"""Learner throughput: one TraceRL update on the SDAR-1.7B shape, bf16, DeepSpeed ZeRO-2, one GPU.

An update is what :class:`dice_ray.cluster.learner.Learner` does each RL step: for each group (one prompt,
G responses) TraceRL's per-token log-probs (:func:`dice_ray.policy.logprobs.response_logprobs`,
estimator ``tracerl``: the prompt encoded once, the clean response once, then the noisy state of each
denoising step: one pass a state under SDPA, one stacked pass for all of them under FlexAttention), the clipped policy loss (:func:`dice_ray.rl.loss.clipped_policy_loss`), a DeepSpeed
backward, and one optimizer step (client ``torch.optim.AdamW``) at the end. The model is a random-init
SDAR-1.7B-shape model (Qwen3-1.7B's shape; see benchmarks/rollout_throughput.py), the data random tokens
with a one-token-a-step trace (every block's ``--steps-per-block`` steps used, so ``steps`` noisy passes).
The process initialises ``torch.distributed`` itself (one rank; NCCL on a GPU, gloo on CPU).

Counted per update (printed): ``processed tokens`` = positions the forwards run = per group
``chunks*P`` (the prompt, batch 1, once a row chunk) + ``G*R`` (clean response) + ``steps*G*R`` (noisy
copies): prompt + response, all positions. MFU = 6 * params * processed tokens / seconds / peak
(``--peak-tflops``, H200 dense bf16 989), with params = all parameters (tied embedding once), gradient-checkpointing recomputation not
counted. Also printed: a stricter "matmul MFU" (6 * non-embedding params * processed tokens + 6 * V * d
* scored tokens, as the LM head runs only where a token is scored) and attention FLOPs separately
(12 * heads * head_dim * attended query-key pairs a layer, forward + backward, pairs the block mask
allows). Tokens/s is given for processed and for trained (response) tokens.

Row chunks (``--rows-per-chunk``, the learner's ``cluster.learner_rows_per_chunk``; ``--micro-batch`` is its old
name): a group's G rows go in chunks of that many, one forward + backward a chunk, gradients accumulated, one
optimizer step an update, through the learner's own code path (``response_logprobs(..., rows=)`` and
``clipped_policy_loss(..., num_sequences=G)``: the whole group's loss); 0 scores the whole group at once. Each
chunk re-encodes the prompt: that is a chunk's cost, counted in the processed tokens (so compare settings by
trained tokens/s). A comma list (``--rows-per-chunk 1,4,0``) measures each setting in this process, one after
the other on the same engine and batch (each with its warm-up, timed updates and peak memory; an out-of-memory
one is reported and the others go on), and prints them side by side: s/update, trained and processed tokens/s,
peak GiB and the time over the whole group's (or the first setting's). The JSON's top-level figures are the
first setting's; ``row_chunk_runs`` holds every setting's.

Gradient checkpointing (``--grad-ckpt``): ``layers`` re-computes whole decoder layers of the noisy
passes in backward, and only the MLPs of the prompt / clean passes (they write the KV cache, so re-running
them would append to it twice; the compiled layers run their MLP inside a compiled region, so there the
prompt / clean passes are not checkpointed); ``mlp`` checkpoints every MLP; ``none``. The ``sdpa`` variants'
attention is the model's ``dice_block`` SDPA with an explicit block mask (FlashAttention does not take a mask,
so PyTorch's memory-efficient kernel serves it unless ``--sdpa-backend`` says otherwise).

Variants (``--variants``, a comma list of ``sdpa``, ``flex``, ``sdpa+compile``, ``flex+compile``; default
``sdpa``, today's path) and fused kernels (``--fused``, a comma list of ``none``, ``liger``; default ``none,liger``
on CUDA, ``none`` on CPU): when more than one (fused, variant) pair is asked for, each is measured in a child
process of this script (``--fused X [--variants V] --out tmp.json``: Liger patches module globals, torch.compile
and DeepSpeed / NCCL state are per process), one after the other, and the parent prints one table (median
s/update, processed tokens/s, MFU, matmul MFU, peak GiB), then each run's speed-up over the first row, the loss of
its first update (taken before any optimizer step: the same number in every variant, up to bf16 rounding) and
the fallbacks it reported, and the ratio liger / none when both ran; a run that fails (out of memory, Liger
missing, a compile error) prints its error line and the others still report. One pair runs in this process.

``sdpa`` is today's path (the model's ``dice_block`` SDPA over the dense block mask); ``flex`` is FlexAttention
over a ``BlockMask`` of the same mask (:func:`dice_ray.policy.model.set_attention`, the learner's
``cluster.learner_attention=flex``: fully masked tiles skipped, and the noisy passes of a call run as one pass
with the states side by side on the sequence axis, :mod:`dice_ray.policy.logprobs`); ``+compile`` adds the compiled decoder layers and
log-prob head (:func:`dice_ray.policy.compiled.compile_layers`, ``cluster.learner_compile=true``; compiled during
the warm-up update, which is not timed). ``liger`` = :func:`dice_ray.policy.fused.apply_fused_kernels`
(Liger-Kernel's SwiGLU and RoPE, the learner's ``cluster.fused_kernels``, its default ``auto`` on a GPU), applied
once the model is on the device, before the attention choice, the compiled layers (which run their own fused code
for both), the checkpointing wrappers and ``deepspeed.initialize``. On CPU the ``flex`` variants run PyTorch's
unfused FlexAttention reference (its CPU backward guard lifted: a smoke test of the plumbing, the numbers mean
nothing there).

The GPU run of issue 42 (one H100 / H200, SDAR-1.7B shape, bf16, the other options at their defaults; a few
minutes, most of them the compile of the last variant; ``--peak-tflops`` 989 is the H100 SXM / H200 dense bf16 peak;
Liger needs the ``gpu`` extra, ``--fused none`` without it):

    python benchmarks/learner_throughput.py --device cuda --fused liger --variants sdpa,flex,flex+compile --out learner.json

The cost of row chunks (issue 42: the presets score DICE's 16 x 4096 groups one sample at a time) beside the whole
group, on one H100 / H200 (the whole group of 16 x 1024 may not fit: it is then reported as out of memory; it goes
last, so that a failed update leaves no half-accumulated DeepSpeed state behind for the others):

    python benchmarks/learner_throughput.py --device cuda --fused none --groups 1 --group-size 16 \\
        --prompt-len 2048 --response-len 1024 --grad-ckpt none --rows-per-chunk 1,4,8,0 --out chunks.json

    python benchmarks/learner_throughput.py [--device cuda] [--groups 2] [--group-size 16] [--rows-per-chunk 8]
        [--prompt-len 512] [--response-len 512] [--steps-per-block 4] [--grad-ckpt layers] [--zero-stage 2]
        [--sdpa-backend auto] [--fused none,liger] [--variants sdpa] [--warmup 1] [--repeats 3]
        [--out learner.json] [--profile top_ops.txt]
    python benchmarks/learner_throughput.py --device cpu --tiny     # seconds; what the CPU test runs
    python benchmarks/learner_throughput.py --device cpu --tiny --rows-per-chunk 0,1,3   # CPU smoke of row chunks
    python benchmarks/learner_throughput.py --device cpu --tiny --variants sdpa,flex,flex+compile   # CPU smoke, ~3 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import make_policy

from dice_ray.policy.compiled import compile_fallback_reason, compile_layers
from dice_ray.policy.fused import apply_fused_kernels
from dice_ray.policy.model import flex_fallback_reason, set_attention
from dice_ray.cluster.learner import row_chunks
from dice_ray.policy.logprobs import response_logprobs
from dice_ray.rl.loss import clipped_policy_loss, merge_chunk_stats

H200_BF16_DENSE_TFLOPS = 989.0
TARGET_MFU = 0.45
GRAD_CKPT = ("none", "mlp", "layers")
SDPA_BACKENDS = ("auto", "efficient", "cudnn", "math", "flash")
FUSED = ("none", "liger")
VARIANTS = ("sdpa", "flex", "sdpa+compile", "flex+compile")


class LayerCheckpointing:
    """Activation checkpointing of the policy's decoder layers that is safe with its :class:`KVCache`.

    A pass that writes the cache (``keep`` is not 0: the prompt and clean passes) must not be re-run in
    backward, or its keys would be appended twice; for those only the MLP (no side effects) is
    checkpointed. Read-only passes (``keep == 0``: TraceRL's noisy copies) checkpoint the whole layer.

    Args:
        model: a ``Qwen3ForCausalLM`` (``model.model.layers``), patched in place.
        mode: ``"mlp"`` (every MLP) or ``"layers"`` (see above).

    Raises:
        ValueError: ``mode`` is not ``"mlp"`` or ``"layers"``.
    """

    def __init__(self, model, mode: str):
        if mode not in ("mlp", "layers"):
            raise ValueError(f"mode {mode!r}: must be 'mlp' or 'layers'")
        self.mode = mode
        self._in_layer = False
        for layer in model.model.layers:
            layer.mlp.forward = self._wrap_mlp(layer.mlp.forward)
            if mode == "layers":
                layer.forward = self._wrap_layer(layer.forward)

    def _wrap_mlp(self, fwd):
        def mlp(x):
            if torch.is_grad_enabled() and not self._in_layer:
                return checkpoint(fwd, x, use_reentrant=False)
            return fwd(x)
        return mlp

    def _wrap_layer(self, fwd):
        def layer(*args, **kwargs):
            cache = kwargs.get("block_kv")
            if not (torch.is_grad_enabled() and cache is not None and cache.keep == 0):
                return fwd(*args, **kwargs)

            def run(*a, **kw):
                self._in_layer = True
                try:
                    return fwd(*a, **kw)
                finally:
                    self._in_layer = False
            return checkpoint(run, *args, use_reentrant=False, **kwargs)
        return layer


def make_batch(groups: int, G: int, P: int, R: int, bs: int, steps: int, vocab: int, mask_id: int, seed: int) -> list[dict]:
    """Random groups: prompt, responses, a trace using ``steps`` denoising steps in every block, behaviour
    log-probs near ``-log V`` (ratios near 1, so the clip rarely zeroes a gradient), advantages +-1.

    Returns:
        per group a dict of CPU tensors: ``prompt_ids`` [P], ``response_ids`` / ``unmask_step`` /
        ``mask`` / ``behaviour_logprobs`` [G, R], ``advantages`` [G].
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        ids = torch.randint(0, vocab - 1, (P + G * R,), generator=gen)
        ids = torch.where(ids >= mask_id, ids + 1, ids)
        order = torch.rand(G, R // bs, bs, generator=gen).argsort(-1)  # a permutation of a block's positions
        out.append({
            "prompt_ids": ids[:P], "response_ids": ids[P:].view(G, R),
            "unmask_step": (order % steps).view(G, R), "mask": torch.ones(G, R, dtype=torch.bool),
            "behaviour_logprobs": -math.log(vocab) + 0.1 * torch.randn(G, R, generator=gen),
            "advantages": torch.randint(0, 2, (G,), generator=gen).float() * 2 - 1,
        })
    return out


def attended_pairs(P: int, R: int, bs: int) -> int:
    """Query-key pairs the block mask allows for one response row in one pass (clean or noisy: equal).

    A response token of block ``b`` (1-based) attends the prompt and blocks ``<= b``: ``P + b * bs`` keys.
    """
    return sum(P + (j // bs + 1) * bs for j in range(R))


def prompt_pairs(P: int, bs: int) -> int:
    """Query-key pairs the block mask allows within a prompt of ``P`` tokens: block-causal in blocks of
    ``bs`` aligned to its end (:func:`dice_ray.policy.model.prompt_blocks`); token ``i`` sees every prompt
    token up to the end of its own block."""
    first = P % bs or bs  # the first block's length (the others are full)
    return sum(first + ((i - first) // bs + 1) * bs if i >= first else first for i in range(P))


def update_flops(args: argparse.Namespace, params: int, embed: int, vocab: int, hidden: int, layers: int,
                 heads: int, head_dim: int) -> dict:
    """FLOPs of one update (forward + backward) and what they count (see the module docstring)."""
    P, R, G, n = args.prompt_len, args.response_len, args.group_size, args.groups
    passes = 1 + args.steps_per_block  # clean + noisy copies
    chunks = len(row_chunks(G, args.rows))  # the prompt is encoded once a chunk
    processed = n * (chunks * P + passes * G * R)
    scored = n * G * R
    pairs = n * (chunks * prompt_pairs(P, args.block_size) + passes * G * attended_pairs(P, R, args.block_size))
    return {
        "processed_tokens": processed, "trained_tokens": scored, "passes_per_group": passes,
        "row_chunks": chunks, "recomputed_prompt_tokens": n * (chunks - 1) * P,
        "model_flops": 6 * params * processed,
        "matmul_flops": 6 * (params - embed) * processed + 6 * vocab * hidden * scored,
        "attention_flops": 12 * heads * head_dim * pairs * layers,
        "counted": f"per group: prompt {P} (batch 1) x {chunks} chunk(s) + clean {G}x{R} + {args.steps_per_block} "
                   f"noisy x {G}x{R} positions; {n} groups",
    }


def init_distributed(device: torch.device) -> None:
    """A one-rank ``torch.distributed`` group for DeepSpeed (NCCL on CUDA, gloo on CPU), if none exists."""
    if torch.distributed.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def make_engine(model, args: argparse.Namespace, device: torch.device):
    """DeepSpeed engine around ``model`` with the learner's optimizer (client AdamW), ZeRO ``--zero-stage``, made
    as the learner makes it (``dice_ray.policy.deepspeed_setup.deepspeed_initialize``: no JIT op built on a CPU)."""
    from dice_ray.policy.deepspeed_setup import deepspeed_initialize

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # the boundary is set by hand, as the learner does
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage, "contiguous_gradients": True, "overlap_comm": False},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": device.type == "cuda"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed_initialize(model=model, optimizer=optimizer, config=config)
    return engine


def one_update(engine, batch: list[dict], args: argparse.Namespace, mask_id: int, device: torch.device) -> dict:
    """One optimizer step over ``batch``, each group in row chunks of ``args.rows`` rows (0: the whole group), one
    forward + backward a chunk, as the learner scores them (``cluster.learner_rows_per_chunk``); a group's loss
    weighs ``1 / groups``. Returns the update's loss (the mean of its groups'), clip fraction and backwards."""
    engine.train()
    work = [(g, rows) for g in batch for rows in row_chunks(g["response_ids"].shape[0], args.rows)]
    parts: dict[int, list] = {}
    for i, (g, rows) in enumerate(work):
        engine.set_gradient_accumulation_boundary(i == len(work) - 1)
        t = {k: v.to(device) for k, v in g.items()}
        lp = response_logprobs("tracerl", engine.module, t["prompt_ids"], t["response_ids"], t["unmask_step"],
                               t["mask"], args.block_size, mask_id, rows=rows)
        loss, stats = clipped_policy_loss(lp, t["behaviour_logprobs"][rows], t["advantages"][rows], t["mask"][rows],
                                          epsilon=0.2, num_sequences=t["response_ids"].shape[0])
        engine.backward(loss / len(batch), scale_wrt_gas=False)
        parts.setdefault(id(g), []).append(stats)
    merged = [merge_chunk_stats(p) for p in parts.values()]
    engine.step()
    return {"loss": statistics.fmean(m.loss for m in merged),
            "clip_fraction": statistics.fmean(m.clip_fraction for m in merged), "micro_batches": len(work)}


def profile_update(engine, batch: list[dict], args: argparse.Namespace, mask_id: int, device: torch.device,
                   path: str) -> None:
    """One more update under ``torch.profiler``; writes the 30 ops with the most device time (CPU time on
    CPU) as a table to ``path`` and prints its first rows: where an update's time goes (GEMMs, attention,
    cross-entropy, optimizer, elementwise)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        one_update(engine, batch, args, mask_id, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=key, row_limit=30, max_name_column_width=70)
    busy = ""
    if device.type == "cuda":  # the kernels' summed time (one stream: no overlap) against the update's wall time
        from torch.autograd import DeviceType

        kernels = sum(e.self_device_time_total for e in averages  # as torch's table footer sums them
                      if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e6
        busy = f"device busy {kernels:.3f} s of a {wall:.3f} s update (profiled) = {kernels / wall:.0%}; the rest waits on the host\n"
    Path(path).write_text(busy + table)
    what = "device" if device.type == "cuda" else "CPU"
    print(f"profile (top ops by self {what} time):\n{busy}" + "\n".join(table.splitlines()[:16]), flush=True)


def _sdpa_context(name: str):
    """``torch.nn.attention.sdpa_kernel`` for ``--sdpa-backend`` (a no-op context for ``auto``)."""
    import contextlib

    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[name]
    return sdpa_kernel([backend])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring); ``--tiny`` shrinks everything for a CPU test."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="sdar-1.7b", choices=("sdar-1.7b", "tiny", "sdar-mini"),
                    help="a model of benchmarks/rollout_throughput.py")
    ap.add_argument("--groups", type=int, default=2, help="groups (prompts) in the update")
    ap.add_argument("--group-size", type=int, default=16, help="G: responses a group")
    ap.add_argument("--rows-per-chunk", "--micro-batch", dest="rows_per_chunk", metavar="0,8,1", default="8",
                    help="rows of a group a forward + backward (the learner's cluster.learner_rows_per_chunk; 0: the "
                    "whole group); a comma list measures each setting side by side in this process")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=512, help="R, a multiple of the block size")
    ap.add_argument("--steps-per-block", type=int, default=4,
                    help="denoising steps the trace uses in each block = TraceRL's noisy passes (<= block size)")
    ap.add_argument("--grad-ckpt", default="layers", choices=GRAD_CKPT)
    ap.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--sdpa-backend", default="auto", choices=SDPA_BACKENDS)
    ap.add_argument("--fused", metavar="none,liger", help="comma list of fused-kernel variants to compare, each in its own process "
                    f"(of {FUSED}; default none,liger on CUDA, none on CPU)")
    ap.add_argument("--variants", metavar="sdpa,flex,flex+compile", default="sdpa",
                    help=f"comma list of learner paths to compare, each in its own process (of {VARIANTS}: attention "
                    "sdpa = today's or flex = FlexAttention, +compile = torch.compile'd decoder layers and log-prob head; "
                    "default sdpa)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="dense bf16 peak for MFU")
    ap.add_argument("--warmup", type=int, default=1, help="untimed updates first")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", metavar="TXT",
                    help="also profile one more update (torch.profiler) and write its top kernels by device time here")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU-test size: sdar-mini, 1 group of 4, 2 rows a chunk, prompt 16, response 16, 1 repeat")
    ap.add_argument("--out", help="write the figures as JSON here")
    if ap.parse_known_args(argv)[0].tiny:  # defaults only: explicit options still win
        ap.set_defaults(model="sdar-mini", groups=1, group_size=4, rows_per_chunk="2", prompt_len=16, response_len=16,
                        repeats=1)
    args = ap.parse_args(argv)
    for flag in ("groups", "group_size", "prompt_len", "response_len", "steps_per_block", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: must be >= 1")
    try:
        args.rows_per_chunk = [int(x) for x in str(args.rows_per_chunk).split(",")]
    except ValueError:
        ap.error(f"--rows-per-chunk {args.rows_per_chunk!r}: a comma list of integers >= 0 (0: the whole group)")
    if any(r < 0 for r in args.rows_per_chunk) or len(set(args.rows_per_chunk)) != len(args.rows_per_chunk):
        ap.error(f"--rows-per-chunk {args.rows_per_chunk}: each entry >= 0 (0: the whole group), none twice")
    args.rows = args.rows_per_chunk[0]
    if args.warmup < 0:
        ap.error("--warmup: must be >= 0")
    cuda = torch.device(args.device).type == "cuda"
    args.fused = (args.fused or ("none,liger" if cuda else "none")).split(",")
    for v in args.fused:
        if v not in FUSED:
            ap.error(f"--fused {v!r}: each variant must be one of {FUSED}")
        if v == "liger" and not cuda:
            ap.error(f"--fused liger: Liger's Triton kernels need a CUDA device (--device {args.device}); on CPU only "
                     "'none' is valid")
    if len(set(args.fused)) != len(args.fused):
        ap.error(f"--fused {','.join(args.fused)}: a variant is named twice")
    args.variants = args.variants.split(",")
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"--variants {v!r}: each variant must be one of {VARIANTS}")
    if len(set(args.variants)) != len(args.variants):
        ap.error(f"--variants {','.join(args.variants)}: a variant is named twice")
    return args


def run_label(fused: str, variant: str, args: argparse.Namespace) -> str:
    """A table row's name: the fused setting, the variant, or ``variant/fused`` when both vary."""
    if len(args.variants) == 1:
        return fused
    return variant if len(args.fused) == 1 else f"{variant}/{fused}"


def _child_argv(argv: list[str], variant: str, out: str, learner_variant: str | None = None) -> list[str]:
    """``argv`` without its ``--fused`` / ``--variants`` / ``--out`` options, plus ``--fused variant [--variants
    learner_variant] --out out`` (and a per-run ``--profile`` file)."""
    kept, skip = [], False
    tag = variant if learner_variant is None else f"{learner_variant.replace('+', '-')}.{variant}"
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--fused", "--variants", "--out", "--profile"):
            skip = "=" not in a
            if name == "--profile":
                path = a.split("=", 1)[1] if "=" in a else argv[i + 1]
                kept += ["--profile", f"{Path(path).with_suffix('')}.{tag}{Path(path).suffix}"]
            continue
        kept.append(a)
    return kept + ["--fused", variant] + ([] if learner_variant is None else ["--variants", learner_variant]) + ["--out", out]


#: a table column: its header, its width (characters, right-aligned) and its cell from a run's figures
Column = tuple[str, int, Callable[[dict], str]]
SECONDS: Column = ("s/update", 9, lambda r: f"{r['seconds']:.3f}")
PROCESSED: Column = ("proc tok/s", 11, lambda r: f"{r['processed_tokens_per_s']:.0f}")
TRAINED: Column = ("trained tok/s", 13, lambda r: f"{r['trained_tokens_per_s']:.0f}")
MFU: Column = ("MFU", 7, lambda r: f"{r['mfu']:.1%}")
MATMUL_MFU: Column = ("matmul MFU", 11, lambda r: f"{r['matmul_mfu']:.1%}")
PEAK: Column = ("peak GiB", 9, lambda r: f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-")


def print_table(first: tuple[str, str], columns: tuple[Column, ...], runs: dict[str, dict]) -> None:
    """Print a blank line, a header and one row a run: its name, then a cell a column, or ``failed: <error>``
    for a run whose figures hold ``"error"``.

    Args:
        first: the name column's header and its format spec (``"<12"``: left-aligned in 12 characters).
        columns: the other columns (:data:`Column`), each cell right-aligned in its width after one space.
        runs: ``{name: figures}`` in the order of the rows.
    """
    head, spec = first
    print(f"\n{head:{spec}}" + "".join(f" {h:>{w}}" for h, w, _ in columns))
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:{spec}} failed: {r['error']}")
        else:
            print(f"{name:{spec}}" + "".join(f" {cell(r):>{w}}" for _, w, cell in columns))


def compare_variants(args: argparse.Namespace, argv: list[str]) -> dict:
    """Run each (``--fused``, ``--variants``) pair in a child process of this script; print one table, each run's
    speed-up, first loss and fallbacks, and the ratio liger / none when both ran.

    Returns:
        ``{"variants": {label: the child's figures, or {"error": its last stderr line}}, "speedup_vs_first":
        {label: processed-tokens/s ratio to the first run that worked}, "liger_over_none": processed-tokens/s ratio
        liger / none (of the first ``--variants`` entry) or None}`` (also written to ``--out``). A label is the fused
        setting (one variant), the variant (one fused setting) or ``variant/fused``.
    """
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fused in args.fused:
            for variant in args.variants:
                label = run_label(fused, variant, args)
                out = os.path.join(tmp, f"{variant.replace('+', '-')}.{fused}.json")
                child = _child_argv(argv, fused, out, None if args.variants == ["sdpa"] else variant)
                print(f"=== {label}: --fused {fused} --variants {variant} (child process) ===", flush=True)
                proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *child],
                                      stderr=subprocess.PIPE, text=True, check=False)
                if proc.returncode == 0 and os.path.exists(out):
                    with open(out) as f:
                        runs[label] = json.load(f)
                else:
                    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
                    runs[label] = {"error": f"exit {proc.returncode}: {lines[-1] if lines else 'no error output'}",
                                   "stderr_tail": "\n".join(lines[-40:])}
                    print(f"{label} FAILED, {runs[label]['error']}", flush=True)
    width = max(8, *(len(k) for k in runs))
    print_table(("variant", f"<{width}"), (SECONDS, PROCESSED, MFU, MATMUL_MFU, PEAK), runs)
    ok = {k: r for k, r in runs.items() if "error" not in r}
    first = next(iter(ok.values()), None)
    speedup = {k: r["processed_tokens_per_s"] / first["processed_tokens_per_s"] for k, r in ok.items()} if first else {}
    if len(ok) > 1:
        for k, r in ok.items():
            loss = f", loss of the first update {r['first_loss']:.6f}" if r.get("first_loss") is not None else ""
            fallback = f", FELL BACK: {r['fallback']}" if r.get("fallback") else ""
            print(f"{k:<{width}} {speedup[k]:.2f}x the first row{loss}{fallback}")
    if first is not None and "cpu" not in (first.get("device"), None):
        best = max(ok, key=lambda k: ok[k]["mfu"])
        print(f"best MFU: {best} {ok[best]['mfu']:.1%} (target >= {TARGET_MFU:.0%}: "
              f"{'met' if ok[best]['mfu'] >= TARGET_MFU else 'NOT met'})")
    ratio = None
    v0 = args.variants[0]
    none = runs.get(run_label("none", v0, args), {"error": 1})
    liger = runs.get(run_label("liger", v0, args), {"error": 1})
    if len(args.fused) > 1 and "error" not in none and "error" not in liger:
        ratio = liger["processed_tokens_per_s"] / none["processed_tokens_per_s"]
        print(f"liger / none: {ratio:.2f}x processed tokens/s (MFU {none['mfu']:.1%} -> {liger['mfu']:.1%}, "
              f"target >= {TARGET_MFU:.0%})")
    result = {"variants": runs, "speedup_vs_first": speedup, "liger_over_none": ratio}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _lift_cpu_flex_backward_guard() -> bool:
    """Let PyTorch's unfused FlexAttention reference run backward on CPU (a smoke test of the ``flex`` plumbing on a
    machine without a GPU; PyTorch refuses it by default). Private API: False when this torch has no such guard."""
    import torch.nn.attention.flex_attention as fa

    if not hasattr(fa, "_validate_device"):
        return False
    fa._validate_device = lambda *a, **k: None
    return True


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns (and with ``--out`` writes) the figures (:func:`compare_variants`'s for several
    ``--fused`` / ``--variants`` entries)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if len(args.fused) > 1 or len(args.variants) > 1:
        return compare_variants(args, argv)
    variant = args.variants[0]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU visible (use --device cpu)")
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/dice-ray/torch_extensions"))
    init_distributed(device)
    t0 = time.perf_counter()
    policy = make_policy(args.model, device, args.seed)
    model, cfg = policy.model, policy.model.config
    fused = apply_fused_kernels(model, args.fused[0])  # on the device, before the checkpoint wrappers and DeepSpeed
    attention = set_attention(model, variant.split("+")[0])
    if attention == "flex" and device.type == "cpu":
        _lift_cpu_flex_backward_guard()
    compiled = compile_layers(model) if variant.endswith("+compile") else 0  # before the checkpoint wrappers
    args.block_size = policy.block_size
    if args.response_len % args.block_size:
        raise SystemExit(f"--response-len {args.response_len}: must be a multiple of the block size {args.block_size}")
    if args.steps_per_block > args.block_size:
        raise SystemExit(f"--steps-per-block {args.steps_per_block}: must be <= the block size {args.block_size}")
    params = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    if args.grad_ckpt != "none":
        LayerCheckpointing(model, args.grad_ckpt)
    model.train()
    engine = make_engine(model, args, device)
    batch = make_batch(args.groups, args.group_size, args.prompt_len, args.response_len, args.block_size,
                       args.steps_per_block, cfg.vocab_size, policy.mask_id, args.seed)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {gpu}; {args.model}: {params / 1e6:.1f} M params ({(params - embed) / 1e6:.1f} M non-embedding), "
          f"{next(model.parameters()).dtype}; DeepSpeed ZeRO-{args.zero_stage}, "
          f"{torch.distributed.get_backend()} x1; grad-ckpt {args.grad_ckpt}; sdpa {args.sdpa_backend}; "
          f"fused {args.fused[0]}{' (' + ', '.join(fused) + ')' if fused else ''}; variant {variant} (attention "
          f"{attention}, {'compiled' if compiled else 'eager'} layers); "
          f"set up in {time.perf_counter() - t0:.1f} s", flush=True)
    setup = {
        "device": gpu, "model": args.model, "params": params, "non_embedding_params": params - embed,
        "dtype": str(next(model.parameters()).dtype), "zero_stage": args.zero_stage,
        "backend": torch.distributed.get_backend(), "grad_ckpt": args.grad_ckpt, "sdpa_backend": args.sdpa_backend,
        "fused": args.fused[0], "fused_kernels": fused, "variant": variant, "attention": attention,
        "compiled_layers": compiled,
    }
    runs: dict[int, dict] = {}
    for rows in args.rows_per_chunk:
        args.rows = rows
        try:
            runs[rows] = {**setup, **measure(engine, batch, args, policy.mask_id, device, params, embed, cfg)}
        except torch.cuda.OutOfMemoryError as e:  # this setting does not fit: the others still report
            runs[rows] = {"rows_per_chunk": rows, "error": f"out of memory: {str(e).splitlines()[0]}"}
            print(f"rows per chunk {rows}: OUT OF MEMORY ({str(e).splitlines()[0]})", flush=True)
            if hasattr(engine, "zero_grad"):  # drop what the failed update accumulated
                engine.zero_grad()
            torch.cuda.empty_cache()
    args.rows = args.rows_per_chunk[0]
    result = dict(runs[args.rows])
    if len(runs) > 1:
        result["row_chunk_runs"] = {str(k): v for k, v in runs.items()}
        print_row_chunks(runs, args.group_size)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def measure(engine, batch: list[dict], args: argparse.Namespace, mask_id: int, device: torch.device, params: int,
            embed: int, cfg) -> dict:
    """Time ``--warmup`` + ``--repeats`` updates with ``args.rows`` rows a chunk; print and return the figures."""
    flops = update_flops(args, params, embed, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers,
                         cfg.num_attention_heads, cfg.head_dim)
    rows = args.rows or args.group_size
    print(f"update: {args.groups} groups x G={args.group_size} ({min(rows, args.group_size)} rows a chunk, "
          f"{flops['row_chunks']} chunk(s) a group), prompt {args.prompt_len}, response {args.response_len}, TraceRL "
          f"{args.steps_per_block} noisy passes + 1 clean; processed tokens {flops['processed_tokens']} "
          f"({flops['counted']}), trained tokens {flops['trained_tokens']}", flush=True)
    secs, peaks, stats = [], [], []
    with _sdpa_context(args.sdpa_backend):
        for i in range(args.warmup + args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            st = one_update(engine, batch, args, mask_id, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peaks.append(torch.cuda.max_memory_allocated(device) / 2**30)
            dt = time.perf_counter() - t
            timed = i >= args.warmup
            if i == 0:
                first_loss = st["loss"]  # before this setting's first optimizer step
            print(f"  update {i + 1}{'' if timed else ' (warm-up)'}: {dt:.3f} s, loss {st['loss']:.4f}, "
                  f"{st['micro_batches']} backwards", flush=True)
            if timed:
                secs.append(dt)
                stats.append(st)
        if args.profile and args.rows == args.rows_per_chunk[0]:  # the first setting's
            profile_update(engine, batch, args, mask_id, device, args.profile)
    sec = statistics.median(secs)
    peak = args.peak_tflops * 1e12
    result = {
        "fallback": "; ".join(filter(None, (flex_fallback_reason(), compile_fallback_reason()))),
        "first_loss": first_loss,
        "groups": args.groups, "group_size": args.group_size, "rows_per_chunk": args.rows,
        "prompt_len": args.prompt_len, "response_len": args.response_len, "steps_per_block": args.steps_per_block,
        "seconds": sec, "seconds_all": secs, **flops,
        "processed_tokens_per_s": flops["processed_tokens"] / sec, "trained_tokens_per_s": flops["trained_tokens"] / sec,
        "mfu": flops["model_flops"] / sec / peak, "matmul_mfu": flops["matmul_flops"] / sec / peak,
        "attention_tflops_per_s": flops["attention_flops"] / sec / 1e12,
        "mfu_with_attention": (flops["model_flops"] + flops["attention_flops"]) / sec / peak,
        "peak_tflops": args.peak_tflops, "peak_gib": max(peaks) if peaks else None,
        "loss": stats[-1]["loss"], "target_mfu": TARGET_MFU,
    }
    params_m = params / 1e6
    print(f"median update {sec:.3f} s: {result['processed_tokens_per_s']:.0f} processed tokens/s, "
          f"{result['trained_tokens_per_s']:.0f} trained (response) tokens/s"
          + (f", peak GPU memory {result['peak_gib']:.1f} GiB" if peaks else ""))
    print(f"MFU (6 x {params_m:.1f} M params x processed tokens / s / {args.peak_tflops:g} TFLOPS): "
          f"{result['mfu']:.1%}" + (f" (target >= {TARGET_MFU:.0%}: {'met' if result['mfu'] >= TARGET_MFU else 'NOT met'})"
                                    if device.type == "cuda" else " (an H200 figure: the target is not judged on CPU)"))
    print(f"  matmul MFU (non-embedding params x processed + LM head x scored tokens): {result['matmul_mfu']:.1%}; "
          f"attention (not in the MFU above; allowed pairs, fwd+bwd): {result['attention_tflops_per_s']:.1f} TFLOP/s, "
          f"MFU with it {result['mfu_with_attention']:.1%}; checkpoint recomputation not counted", flush=True)
    return result


def print_row_chunks(runs: dict[int, dict], group_size: int) -> None:
    """The ``--rows-per-chunk`` settings side by side: s/update, trained and processed tokens/s, peak GiB, and the
    time over the whole group's (0), else over the first setting's."""
    ok = [k for k, r in runs.items() if "error" not in r]
    base_key = 0 if 0 in ok else next(iter(ok), None)
    base = runs.get(base_key) if base_key is not None else None
    chunks: Column = ("chunks", 6, lambda r: f"{r['row_chunks']}")
    time_over_base: Column = ("time", 7, lambda r: f"{r['seconds'] / base['seconds']:.2f}x")
    print_table(("rows/chunk", ">10"), (chunks, SECONDS, TRAINED, PROCESSED, PEAK, time_over_base),
                {f"{k or group_size}{' (0)' if k == 0 else ''}": r for k, r in runs.items()})
    if base is None:
        return
    what = "the whole group's" if base_key == 0 else f"the first setting's ({base_key} rows a chunk)"
    print(f"time: s/update over {what}; a chunk re-encodes the prompt (processed tokens count it), the trained tokens "
          "are the same in every setting; first losses (each setting's first update, after the earlier settings' "
          "steps): " + ", ".join(f"{k}: {runs[k]['first_loss']:.6f}" for k in ok), flush=True)


if __name__ == "__main__":
    main()
