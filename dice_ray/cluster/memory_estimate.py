"""Per-GPU memory of each role of a run, estimated from its config alone (no weights read, no actor started).

Used by :mod:`dice_ray.cluster.plan` (``dice-ray train --dry-run``). Every figure is in bytes; each role's
estimate is split by component so the plan can show where the memory goes.

**The policy's shape** (:func:`model_shape`) comes from ``model.path`` when this machine can read it (a
checkpoint's ``config.json``, a dice-ray policy's ``model_config.json``, a run directory's newest policy, a
Hugging Face id already in the local hub cache; the parameter count then is exact, summed from the
safetensors headers), else from the ``model.*`` keys (the parameter count by :func:`count_params`, which
equals the built transformers model's: ``tests/test_plan.py`` checks every family on the meta device).

**Learner** (one DeepSpeed rank of ``cluster.learner_ranks``; P parameters, N ranks, 16-bit weights when
``model.dtype=bfloat16``, else fp32 with no mixed precision):

==========  =====================================  ==========================================================
ZeRO stage  weights / gradients / optimizer         notes
==========  =====================================  ==========================================================
0           2P / 6P / 12P  (fp32: 4P / 4P / 8P)    bf16: DeepSpeed's BF16_Optimizer (fp32 gradient and master copies)
1           2P / 2P / 16P/N                          fp32 master, gradient partition and AdamW moments partitioned
2           2P / 6P/N / 12P/N                        = DeepSpeed's ``estimate_zero2_model_states_mem_needs``: 2P + 18P/N
3           2P/N + 4L / 4P/N / 12P/N                 = DeepSpeed's ``estimate_zero3_model_states_mem_needs``: 18P/N + 4L
==========  =====================================  ==========================================================

L is the largest layer's parameter count (the embedding), gathered whole under ZeRO-3. ``cluster.learner_offload``
moves what DeepSpeed's estimators move to CPU memory (optimizer states; ZeRO-3: parameters too). Where DeepSpeed
has an estimator (stages 2 and 3, 16-bit) its number is reported beside the breakdown
(:func:`deepspeed_model_states`), and the two agree (``tests/test_plan.py``). With ``rl.beta > 0`` each rank also
holds the frozen KL reference: a whole copy of the policy in its dtype, not partitioned.

**Learner activations** (:func:`learner_activations`): the learner holds the autograd graph of one backward: a
row chunk of every group of a micro-batch (with ``cluster.gradient_checkpointing``: of one group's chunk,
recomputed in the backward pass). A row chunk is ``cluster.learner_rows_per_chunk`` of a group's G samples (0: all
G; :func:`chunk_rows`); every pass below runs with its rows (the prompt's with one row, re-encoded a chunk), so
what follows counts C = the chunk's rows where it says G. For SDAR a
group is scored in the ``x_t ‖ x_0`` layout: one pass over the prompt (1 row), one over the clean responses
(G rows x R), and one per noisy state (G rows x R each; TraceRL: ``model.block_size`` states with dynamic
remasking, ``sampling.steps_per_block`` with static; coupled: 2). LLaDA / Dream run one full forward of
G x (prompt + R) tokens per state (TraceRL: every denoising step, ``R x steps_per_block / block_size``; coupled:
2). diffu_grpo is one forward with the response masked (SDAR: G x (prompt + R); LLaDA / Dream: one row).
Each pass keeps, per query token and layer, ``4h + 5·H·d + 2·Hkv·d + 2d + 4I`` elements in the weights' dtype
for SDAR (``4h + 4·H·d + Hkv·d + 2d + 4I`` for LLaDA / Dream; :func:`per_token_elements`), plus the keys and
values attended (``2 · rows · keys · Hkv·d``: the cache concatenated with the new ones) and the float mask SDPA
makes of the boolean one, repeated for the query heads that share a KV head (``rep · queries · keys`` a layer),
and attention's fp32 log-sum-exp. Each scored token keeps its fp32 log-softmax over the vocabulary (``4V``
bytes), and the pass that scores the most tokens briefly holds its logits twice more (``6V``). On CPU torch's
composite RMSNorm also keeps the normalized input before the weight; ``tests/test_plan.py`` adds that and finds
the estimate within 15 % of the bytes autograd saves, every estimator and family. R is ``sampling.max_new_tokens`` (a group is padded to its longest response: the worst case
is the budget) and the prompt is ``--prompt-tokens`` (default by template: 512 compact, 2048 dice), capped so
prompt + response fits ``model.max_position_embeddings``.

**Rollout worker**: the weights in ``model.dtype``, the KV cache of one sampling batch (SDAR: ``2 · layers · Hkv · d ·
bytes · rows · (prompt + max_new_tokens + block)``, preallocated by the sampler; ``rows``: :func:`rollout_batch_rows`,
the groups of a ``generate`` call packed ``sampling.max_batch_rows`` rows a batch) and the logits of a block of
every row; LLaDA / Dream decode one group at a time and keep no cache but run a full forward over the G x
(prompt + R) canvas every step (one layer's MLP intermediates and the logits of the canvas).

**Verifier**: ``verify.gpu_memory_fraction`` of the whole GPU's memory (its sandbox workers and spares).

**Runtime**: 1 GiB a GPU process (CUDA context, NCCL, allocator slack), DeepSpeed's communication buckets
(ZeRO 1-2: the reduce bucket, ``min(P, 5e8)`` elements; ZeRO-3: the prefetch bucket, 5e7), and the weight
broadcast's bucket (``cluster.weight_sync_bucket_mb``) when weights go by broadcast.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from dice_ray.config import DiceConfig, ModelConfig

GIB = 1024**3
RUNTIME_BYTES = GIB
"""A GPU process's CUDA context, NCCL communicators and allocator slack (bytes)."""
DS_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` (elements; ZeRO 1-2) and ``stage3_prefetch_bucket_size`` below."""
DS_PREFETCH_BUCKET = 50_000_000
PROMPT_TOKENS = {"compact": 512, "dice": 2048}
"""Assumed prompt length (tokens) by ``tasks.prompt_template`` when ``--prompt-tokens`` is not given: the compact
prompts of the built-in suite stay under the tiny policy's ~600-token budget; DICE's prompts (the reference, a
scaffold, a worked load_inline example) run to about 2,000."""
CHECKPOINT_VOCAB = {"sdar": 151936, "llada": 126464, "dream": 152064}
"""Vocabulary of the family's released checkpoints (SDAR / Qwen3, LLaDA, Dream / Qwen2.5), assumed when
``model.path`` cannot be read here."""


def param_count(n: int) -> str:
    """``1.72 B``, ``0.92 M``: a parameter count as the learner's line writes it."""
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"



@dataclass(frozen=True)
class ModelShape:
    """What the memory of a policy depends on.

    Attributes:
        family: ``sdar`` / ``llada`` / ``dream``.
        hidden, intermediate, layers, heads, kv_heads, head_dim, vocab: the transformer's shape.
        tied: input embedding and LM head shared.
        dtype_bytes: bytes of a weight (2 bf16, 4 fp32).
        params: parameter count (exact from safetensors headers when read, else :func:`count_params`).
        largest_layer: parameters of the largest module (DeepSpeed's ``largest_layer_params``: the embedding).
        max_positions: ``max_position_embeddings``.
        block_size: tokens a diffusion block.
        source: where the shape came from, for the plan's notes.
    """

    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype_bytes: int
    params: int
    largest_layer: int
    max_positions: int
    block_size: int
    source: str


def count_params(family: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 head_dim: int, vocab: int, tied: bool) -> int:
    """Parameters of the family's transformers model (Qwen3 for SDAR: q/k norms; Llama for LLaDA: no biases;
    Qwen2 for Dream: q/k/v biases), as :func:`dice_ray.policy.families.build_model` builds it."""
    q, kv = heads * head_dim, kv_heads * head_dim
    layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * intermediate + 2 * hidden
    if family == "sdar":
        layer += 2 * head_dim  # q_norm, k_norm
    elif family == "dream":
        layer += q + 2 * kv  # q/k/v biases
    return vocab * hidden * (1 if tied else 2) + layers * layer + hidden


def _safetensors_params(folder: Path) -> int | None:
    """Parameter count of the ``*.safetensors`` files in ``folder`` from their headers (no tensor read); a tensor
    stored under two names (tied weights) counts once; None when there is no such file or one is unreadable."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total, seen = 0, set()
    try:
        for f in files:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                key = (f.name, tuple(meta["data_offsets"]))
                if key not in seen:
                    seen.add(key)
                    total += math.prod(meta["shape"])
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return total


def _local_folder(path: str) -> Path | None:
    """The folder ``model.path`` stands for on this machine, without any download: a folder, a run directory's
    newest policy, or a hub id's snapshot already in the local hub cache; None otherwise."""
    p = Path(path).expanduser()
    if p.is_dir():
        ckpts = p / "checkpoints"
        if ckpts.is_dir() and not any((p / f).is_file() for f in ("model_config.json", "config.json")):
            policies = sorted(ckpts.glob("step_*/policy"))
            return policies[-1] if policies else None
        return p
    if p.exists() or "/" not in path or path.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        repo, _, revision = path.partition("@")
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=["config.json"],
                                      local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a hub id, no huggingface_hub: the keys stand in
        return None


def _tiny_vocab() -> int:
    """Vocabulary of the shipped tokenizer (the policy built without ``model.path``)."""
    from dice_ray.policy.tokenizer import ASSET_PATH, DiceTokenizer

    return DiceTokenizer.load(ASSET_PATH).vocab_size


def _shape(family: str, m: dict, vocab: int, tied: bool, dtype: str, block_size: int, source: str,
           params: int | None = None) -> ModelShape:
    hd = m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]
    kvh = m.get("num_key_value_heads") or m["num_attention_heads"]
    dims = (m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"], m["num_attention_heads"], kvh, hd)
    counted = count_params(family, *dims, vocab, tied)
    h, inter = m["hidden_size"], m["intermediate_size"]
    return ModelShape(family, *dims, vocab=vocab, tied=tied, dtype_bytes=2 if dtype == "bfloat16" else 4,
                      params=params or counted, largest_layer=max(vocab * h, h * inter),
                      max_positions=m.get("max_position_embeddings") or 4096, block_size=block_size, source=source)


def model_shape(cfg: ModelConfig) -> ModelShape:
    """The policy's shape: from ``model.path`` when readable here (see the module docstring), else the keys.

    Raises:
        ValueError: a readable folder whose config lacks a shape key (the message names the file and key).
    """
    keys = cfg.model_dump()
    if not cfg.path:
        return _shape(cfg.family, keys, _tiny_vocab(), cfg.tie_word_embeddings, cfg.dtype, cfg.block_size,
                      "model.* keys (built, the shipped tokenizer's vocabulary)")
    folder = _local_folder(cfg.path)
    if folder is None:
        vocab = CHECKPOINT_VOCAB[cfg.family]
        return _shape(cfg.family, keys, vocab, cfg.tie_word_embeddings, cfg.dtype, cfg.block_size,
                      f"model.* keys: model.path {cfg.path} is not readable here ({cfg.family} checkpoint "
                      f"vocabulary {vocab} assumed)")
    params = _safetensors_params(folder)
    counted = "" if params else ", parameters counted from the shape"
    if (folder / "model_config.json").is_file():  # a dice-ray policy folder: its config decides everything
        own = ModelConfig.model_validate_json((folder / "model_config.json").read_text())
        tok = folder / "tokenizer.json"
        from dice_ray.policy.tokenizer import DiceTokenizer

        vocab = DiceTokenizer.load(tok).vocab_size if tok.is_file() else _tiny_vocab()
        return _shape(own.family, own.model_dump(), vocab, own.tie_word_embeddings, own.dtype, own.block_size,
                      f"{folder / 'model_config.json'}{counted}", params)
    file = folder / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path {cfg.path}: cannot read {file} ({e})") from None
    try:
        if "d_model" in raw:  # LLaDA's own keys (families._llada_to_llama_config)
            m = {"hidden_size": raw["d_model"], "num_attention_heads": raw["n_heads"],
                 "intermediate_size": raw.get("mlp_hidden_size") or raw.get("mlp_ratio", 4) * raw["d_model"],
                 "num_hidden_layers": raw["n_layers"], "num_key_value_heads": raw.get("n_kv_heads"),
                 "max_position_embeddings": raw.get("max_sequence_length", 4096)}
            vocab, tied = raw.get("embedding_size") or raw["vocab_size"], bool(raw.get("weight_tying", False))
        else:
            m = {k: raw[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
            m.update(num_key_value_heads=raw.get("num_key_value_heads"), head_dim=raw.get("head_dim"),
                     max_position_embeddings=raw.get("max_position_embeddings"))
            vocab, tied = raw["vocab_size"], bool(raw.get("tie_word_embeddings", False))
    except KeyError as e:
        raise ValueError(f"model.path {cfg.path}: {file} has no {e.args[0]!r} key") from None
    return _shape(cfg.family, m, vocab, tied, cfg.dtype, cfg.block_size, f"{file}{counted}", params)


# ---- the learner ---------------------------------------------------------------------------------------------


@dataclass
class Estimate:
    """One actor's memory on its GPU, by component (bytes), with the lines that explain it.

    ``host``: bytes it needs in CPU memory (offloaded states), shown but not checked. ``deepspeed``: DeepSpeed's
    own estimate of the model states on the GPU, where it has one.
    """

    components: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    host: int = 0
    deepspeed: int | None = None

    @property
    def total(self) -> int:
        return sum(self.components.values())


def model_states(shape: ModelShape, stage: int, ranks: int, offload: bool) -> dict[str, int]:
    """Weights, gradients and optimizer states of one learner rank on its GPU, and what ``offload`` puts in CPU
    memory (``host``), by the table of the module docstring."""
    P, N, L = shape.params, ranks, shape.largest_layer
    half = shape.dtype_bytes == 2
    if stage == 0:
        w, g, o = (2 * P, 6 * P, 12 * P) if half else (4 * P, 4 * P, 8 * P)
        return {"weights": w, "gradients": g, "optimizer": o, "host": 0}
    wb = 2 if half else 4
    if stage == 1:
        w, g, o = wb * P, wb * P, 16 * P // N
    elif stage == 2:
        w, g, o = wb * P, 6 * P // N, 12 * P // N
    else:
        w, g, o = 2 * P // N + 4 * L, 4 * P // N, 12 * P // N
    if not offload:
        return {"weights": w, "gradients": g, "optimizer": o, "host": 0}
    if stage == 3:  # parameters and optimizer in CPU memory; the gathered layer stays
        return {"weights": 4 * L, "gradients": 0, "optimizer": 0, "host": 18 * P // N}
    return {"weights": w, "gradients": 0, "optimizer": 0, "host": 16 * P // N}


def deepspeed_model_states(shape: ModelShape, stage: int, gpus_per_node: int, nodes: int, offload: bool) -> int | None:
    """DeepSpeed's own GPU estimate (bytes) of one rank's model states, from
    ``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`` (stage 2) or
    ``...stage3.estimate_zero3_model_states_mem_needs`` (stage 3); None for stages 0-1 (DeepSpeed has no
    estimator), an fp32 policy (its estimators assume 16-bit weights) or when DeepSpeed does not import."""
    if stage < 2 or shape.dtype_bytes != 2:
        return None
    import logging

    quiet = logging.Filter()
    quiet.filter = lambda record: record.levelno >= logging.ERROR  # its import's accelerator line goes to stdout
    log = logging.getLogger("DeepSpeed")
    log.addFilter(quiet)
    try:
        if stage == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

            return int(estimate_zero2_model_states_mem_needs(shape.params, gpus_per_node, nodes, cpu_offload=offload)[1])
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return int(estimate_zero3_model_states_mem_needs(shape.params, shape.largest_layer, gpus_per_node, nodes,
                                                         cpu_offload=offload, cpu_offload_params=offload)[1])
    except Exception:  # noqa: BLE001 - no DeepSpeed, or another signature: the formula stands alone
        return None
    finally:
        log.removeFilter(quiet)


def prompt_tokens(cfg: DiceConfig, shape: ModelShape, given: int | None = None) -> int:
    """The prompt length the plan assumes: ``given`` (``--prompt-tokens``), else by template
    (:data:`PROMPT_TOKENS`), at most what fits ``max_position_embeddings`` with ``sampling.max_new_tokens``."""
    want = given if given is not None else PROMPT_TOKENS.get(cfg.tasks.prompt_template, 512)
    return max(1, min(want, shape.max_positions - cfg.sampling.max_new_tokens))


def scoring_states(cfg: DiceConfig, shape: ModelShape) -> int:
    """Noisy states the learner scores a group in (each one forward pass), by estimator and family."""
    est, s = cfg.rl.logprob_estimator, cfg.sampling
    if est == "coupled":
        return 2
    if est == "diffu_grpo":
        return 1
    if shape.family == "sdar":
        return shape.block_size if s.remasking == "dynamic" else min(s.steps_per_block, shape.block_size)
    return max(1, math.ceil(s.max_new_tokens * s.steps_per_block / shape.block_size))


def per_token_elements(shape: ModelShape) -> int:
    """Elements one layer of a training forward keeps for the backward pass per query token, in the weights'
    dtype, with torch's fused RMSNorm (CUDA): each norm's input and output (the next matmul's input), SDAR's q/k
    norms' inputs and outputs (the rotary multiply keeps its input; LLaDA / Dream: q and k before RoPE), the
    rotary cos and sin, the query attention reads, its output and o_proj's input, and the MLP's gate, its
    activation, up and their product."""
    h, q, kv, inter = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    qk = 2 * q + 2 * kv if shape.family == "sdar" else q + kv
    return 4 * h + qk + 3 * q + 2 * shape.head_dim + 4 * inter


def _pass_bytes(shape: ModelShape, rows: int, queries: int, keys: int) -> int:
    """Autograd memory of one training forward over ``rows`` x ``queries`` tokens attending ``keys`` keys: per
    layer :func:`per_token_elements` a query token, the keys and values attended (``2 · Hkv·d`` a key and row),
    the log-sum-exp of attention (fp32, a head) and the mask SDPA makes of the boolean one (in the weights'
    dtype, repeated for the query heads that share a KV head); the final norm's input."""
    b, kv = shape.dtype_bytes, shape.kv_heads * shape.head_dim
    rep = shape.heads // shape.kv_heads
    per_layer = (rows * queries * per_token_elements(shape) + 2 * rows * keys * kv + rep * queries * keys) * b
    per_layer += rows * queries * shape.heads * 4
    return shape.layers * per_layer + rows * queries * shape.hidden * b


def chunk_rows(cfg: DiceConfig) -> int:
    """Rows (samples) of a group the learner scores in one backward: ``cluster.learner_rows_per_chunk``, at most
    ``rl.num_generations`` (0: the whole group)."""
    G = cfg.rl.num_generations
    return min(G, cfg.cluster.learner_rows_per_chunk or G)


def group_activations(cfg: DiceConfig, shape: ModelShape, prompt: int) -> tuple[int, str]:
    """Autograd memory (bytes) of scoring one row chunk of a group (:func:`chunk_rows` of the G responses of R
    tokens; the whole group without ``cluster.learner_rows_per_chunk``), and the line explaining it."""
    G, R, V = chunk_rows(cfg), cfg.sampling.max_new_tokens, shape.vocab
    n = scoring_states(cfg, shape)
    if cfg.rl.logprob_estimator == "diffu_grpo":  # one forward, the whole response masked
        rows, T = (G, prompt + R) if shape.family == "sdar" else (1, prompt + R)
        passes = _pass_bytes(shape, rows, T, T)
        what = f"one masked forward of {rows}x({prompt}+{R}) tokens"
    elif shape.family == "sdar":
        passes = (_pass_bytes(shape, 1, prompt, prompt) + _pass_bytes(shape, G, R, prompt + R)
                  + n * _pass_bytes(shape, G, R, prompt + 2 * R))
        what = f"prompt {prompt} + clean {G}x{R} + {n} noisy state(s) x {G}x{R} tokens"
    else:
        T = prompt + R
        passes = n * _pass_bytes(shape, G, T, T)
        what = f"{n} full state(s) x {G}x({prompt}+{R}) tokens"
    scored = G * R
    logits = scored * V * 4 + math.ceil(scored / n) * V * 6 + scored * shape.hidden * shape.dtype_bytes
    if G < cfg.rl.num_generations:
        what = (f"a row chunk of {G} of {cfg.rl.num_generations} rows (cluster.learner_rows_per_chunk="
                f"{cfg.cluster.learner_rows_per_chunk}, the prompt re-encoded a chunk): {what}")
    return passes + logits, what


def groups_per_micro_batch(cfg: DiceConfig, prompt: int) -> int:
    """Groups whose autograd graphs the learner holds at once: as many as ``cluster.micro_batch_tokens`` packs
    (a group counting G x (prompt + R) tokens; :func:`dice_ray.cluster.learner.pack_micro_batches`), one with
    ``cluster.gradient_checkpointing`` or a budget of 0."""
    budget, group_tokens = cfg.cluster.micro_batch_tokens, cfg.rl.num_generations * (prompt + cfg.sampling.max_new_tokens)
    k = 1 if cfg.cluster.gradient_checkpointing or budget == 0 else max(1, budget // group_tokens)
    return min(k, cfg.rl.prompts_per_step)


def learner_activations(cfg: DiceConfig, shape: ModelShape, prompt: int) -> tuple[int, str]:
    """Autograd memory (bytes) the learner holds at once: a row chunk (:func:`chunk_rows`) of each group of a
    micro-batch (``cluster.micro_batch_tokens``, a group counting G x (prompt + R)), or of one group with
    ``cluster.gradient_checkpointing``."""
    one, what = group_activations(cfg, shape, prompt)
    budget, group_tokens = cfg.cluster.micro_batch_tokens, cfg.rl.num_generations * (prompt + cfg.sampling.max_new_tokens)
    k = groups_per_micro_batch(cfg, prompt)
    why = ("gradient checkpointing: one group" if cfg.cluster.gradient_checkpointing
           else f"{k} group(s) a micro-batch (cluster.micro_batch_tokens={budget}; a group is {group_tokens} tokens, "
                f"G x (prompt + R), and is never split)")
    of = "of each group a backward holds" if chunk_rows(cfg) < cfg.rl.num_generations else "a group:"
    return k * one, f"{why}; {of} {what}, R = sampling.max_new_tokens"


def learner_estimate(cfg: DiceConfig, shape: ModelShape, prompt: int, gpus_per_node: int, nodes: int,
                     on_gpu: bool = True, broadcast: bool = False, with_deepspeed: bool = True) -> Estimate:
    """One learner rank's memory (:class:`Estimate`); ``gpus_per_node`` / ``nodes``: how its ranks spread
    (DeepSpeed's estimators take them; only the CPU side depends on them). ``with_deepspeed``: also ask DeepSpeed's
    estimator (importing DeepSpeed takes seconds; its number equals the breakdown's)."""
    c = cfg.cluster
    ranks = c.learner_ranks
    states = model_states(shape, c.zero_stage, ranks, c.learner_offload)
    est = Estimate(host=states.pop("host"))
    est.components.update(states)
    gib = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    est.notes.append(f"{param_count(shape.params)} parameters ({shape.source}); ZeRO-{c.zero_stage} over {ranks} "
                     f"rank(s){', offload to CPU' if c.learner_offload else ''}: weights {gib(states['weights'])}, "
                     f"gradients {gib(states['gradients'])}, optimizer {gib(states['optimizer'])} GiB")
    if cfg.rl.beta > 0:
        est.components["weights"] += shape.params * shape.dtype_bytes
        est.notes.append(f"rl.beta={cfg.rl.beta}: the frozen KL reference, a whole copy of the weights on every "
                         f"rank, {gib(shape.params * shape.dtype_bytes)} GiB (in weights)")
    if with_deepspeed:
        est.deepspeed = deepspeed_model_states(shape, c.zero_stage, gpus_per_node, nodes, c.learner_offload)
    if est.deepspeed is not None:
        mine = sum(states.values())
        est.notes.append(f"DeepSpeed's estimator for these model states: {gib(est.deepspeed)} GiB (the breakdown: "
                         f"{gib(mine)})")
    act, why = learner_activations(cfg, shape, prompt)
    est.components["activations"] = act
    est.notes.append(f"activations {gib(act)} GiB: {why}, prompt {prompt} tokens")
    runtime = RUNTIME_BYTES if on_gpu else 0
    if c.zero_stage in (1, 2):
        runtime += min(shape.params, DS_REDUCE_BUCKET) * shape.dtype_bytes
    elif c.zero_stage == 3:
        runtime += min(shape.params, DS_PREFETCH_BUCKET) * shape.dtype_bytes
    if broadcast:
        runtime += int(c.weight_sync_bucket_mb * 2**20)
    est.components["runtime"] = runtime
    return est


# ---- rollout and verifier -----------------------------------------------------------------------------------


def rollout_batch_rows(cfg: DiceConfig) -> tuple[int, str]:
    """Rows of the largest SDAR sampling batch a rollout worker holds, and where they come from, in words.

    A ``generate`` call's groups (G rows each) are decoded up to ``max(1, sampling.max_batch_rows // G)`` groups a
    batch (:func:`~dice_ray.policy.task_sampling.sample_task_groups`). The calls: a training step's prompts
    (``rl.prompts_per_step`` x ``rl.num_generations``; one worker may get them all, e.g. a lane of one worker) and
    the evaluations (``eval.train_tasks`` x ``eval.samples``, ``eval.heldout_tasks`` x ``eval.heldout_samples``).
    """
    cap = cfg.sampling.max_batch_rows
    calls = [("rl.prompts_per_step", cfg.rl.prompts_per_step, cfg.rl.num_generations),
             ("eval.train_tasks", cfg.eval.train_tasks, cfg.eval.samples),
             ("eval.heldout_tasks", cfg.eval.heldout_tasks, cfg.eval.heldout_samples)]
    rows, why = 0, ""
    for key, groups, G in calls:
        n = G * min(groups, max(1, cap // G))
        if groups and n > rows:
            rows, why = n, f"{n // G} group(s) of {G} ({key}={groups}, sampling.max_batch_rows={cap})"
    return rows, why


def rollout_estimate(cfg: DiceConfig, shape: ModelShape, prompt: int, on_gpu: bool = True,
                     broadcast: bool = False) -> Estimate:
    """One rollout worker's memory: weights, the KV cache of its largest sampling batch (SDAR; LLaDA / Dream: one
    group), the sampling working set, runtime."""
    G, R, V, b = cfg.rl.num_generations, cfg.sampling.max_new_tokens, shape.vocab, shape.dtype_bytes
    est = Estimate()
    est.components["weights"] = shape.params * b
    kv_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * b
    if shape.family == "sdar":
        rows, why = rollout_batch_rows(cfg)
        length = prompt + R + shape.block_size
        est.components["kv_cache"] = kv_token * rows * length
        est.components["working"] = rows * shape.block_size * V * 4 * 2
        est.notes.append(f"KV cache of one sampling batch: {rows} rows, {why}, x ({prompt} prompt + {R} new + "
                         f"{shape.block_size}) tokens x {kv_token // 1024} KiB a token")
    else:
        T = prompt + R
        est.components["kv_cache"] = 0
        est.components["working"] = G * T * (2 * shape.hidden + 3 * shape.intermediate) * b + G * R * V * 4
        est.notes.append(f"no KV cache ({shape.family}): a full forward over {G} x ({prompt} + {R}) tokens a step")
    est.components["runtime"] = (RUNTIME_BYTES if on_gpu else 0) + (int(cfg.cluster.weight_sync_bucket_mb * 2**20)
                                                                    if broadcast else 0)
    return est


def verifier_estimate(cfg: DiceConfig, gpu_bytes: int | None) -> Estimate:
    """A GPU verifier's memory: ``verify.gpu_memory_fraction`` of the whole GPU (None: capacity unknown)."""
    frac = cfg.verify.gpu_memory_fraction
    est = Estimate(notes=[f"verify.gpu_memory_fraction={frac} of the GPU's memory (sandbox workers and spares)"])
    if gpu_bytes is not None:
        est.components["verifier"] = int(frac * gpu_bytes)
    return est
