"""SFT data as the loop takes it: (prompt, target) texts (LLaDA / Dream infilling: (before, middle, after) triples) to
token ids, and an epoch's batches of similar length."""

from __future__ import annotations

import torch

from dice_ray.policy.logprobs import BIDIRECTIONAL
from dice_ray.policy.policy import DiffusionPolicy


def tokenize_pairs(policy: DiffusionPolicy, pairs: list[tuple[str, ...]]) -> list[tuple[list[int], ...]]:
    """Token ids of (prompt, target) pairs and (LLaDA / Dream) (before, middle, after) infill triples.

    Items keep their pair's shape: ``(prompt_ids, target_ids)`` or ``(before_ids, middle_ids, after_ids)``. Targets
    (middles) end with ``<|eos|>``, padded with it to whole blocks; ``after`` is encoded as it is (may be empty).

    Raises:
        ValueError: a pair of neither 2 nor 3 texts, a triple for SDAR (it keeps the scaffold in its prompt), an empty
            prompt, or prompt + target (+ after) longer than ``max_position_embeddings``.
    """
    out = []
    bs, limit = policy.block_size, policy.model_cfg.max_position_embeddings
    for i, pair in enumerate(pairs):
        if len(pair) not in (2, 3):
            raise ValueError(f"pairs[{i}]: must be (prompt, target) or, LLaDA / Dream, (before, middle, after); "
                             f"got {len(pair)} texts")
        if len(pair) == 3 and policy.family not in BIDIRECTIONAL:
            raise ValueError(f"pairs[{i}]: a (before, middle, after) triple infills in place, for LLaDA / Dream; SDAR "
                             "keeps the scaffold in its prompt: pass (prompt, middle)")
        p = policy.encode(pair[0])
        t = policy.encode(pair[1]) + [policy.eos_id]
        t += [policy.eos_id] * (-len(t) % bs)
        after = [policy.encode(pair[2])] if len(pair) == 3 else []
        if not p:
            raise ValueError(f"pairs[{i}]: the prompt is empty")
        if len(p) + len(t) + sum(map(len, after)) > limit:
            also = f" + {len(after[0])} after" if after else ""
            raise ValueError(
                f"pairs[{i}]: {len(p)} prompt + {len(t)} target{also} tokens exceed max_position_embeddings={limit}"
            )
        out.append((p, t, *after))
    return out


def length_batches(costs: list[int], batch_size: int, generator: torch.Generator) -> list[list[int]]:
    """One epoch of batches of similar cost ("sortish" sampling: less padding, still random).

    Shuffles the indices, sorts each run of ``4 * batch_size`` by cost, cuts it into batches and shuffles
    the batch order. Every index appears exactly once.
    """
    perm = torch.randperm(len(costs), generator=generator).tolist()
    chunk = 4 * batch_size
    batches = []
    for i in range(0, len(perm), chunk):
        run = sorted(perm[i : i + chunk], key=lambda j: costs[j])
        batches += [run[k : k + batch_size] for k in range(0, len(run), batch_size)]
    order = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in order]
