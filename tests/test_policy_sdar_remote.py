"""SDAR's public remote code vs dice-ray's transformers-native SDAR (issue 5): the same logits on a tiny config.

dice-ray never runs a checkpoint's remote code: SDAR / TraDo / DICE load into ``Qwen3ForCausalLM`` with the
project's block-causal attention (:mod:`dice_ray.policy.families`, :mod:`dice_ray.policy.model`). This file
checks that choice against the remote code itself: a random tiny ``SDARForCausalLM`` (remote classes) is saved
with its own ``save_pretrained``, loaded by :func:`dice_ray.policy.families.load_checkpoint`, and both models
score the same inputs under the same attention pattern (fp32, max abs logit difference <= 1e-5):

* one plain block-causal sequence (prompt of 6 tokens, 3 response blocks of 4), the mask from
  :func:`dice_ray.policy.model.block_mask`, given to both models;
* the remote code's own generation mask (``_build_full_attention_mask``): equal to ours for a one-block
  prompt and for a longer one (both split the prompt into block-causal blocks aligned to its end,
  :func:`dice_ray.policy.model.prompt_blocks`); the old dice-ray layout (the prompt one bidirectional block)
  differs there;
* the training layout: the remote's ``x_t ‖ x_0`` sequence with its own ``block_diff_mask`` (blocks counted
  from position 0) vs the project's clean ‖ noisy layout, for prompts of 1 and 2 blocks, by a full forward
  and by the TraceRL scoring path (``_score_noisy_states``).

A deliberately wrong block length gives a large difference (the test can fail).

The remote code is not vendored (public code stays out of the project): set ``DICE_SDAR_REMOTE_CODE`` to a folder
holding ``modeling_sdar.py`` and ``configuration_sdar.py`` (an SDAR Hugging Face repository's remote code);
otherwise every test here is skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from _helpers import TINY_FAMILY_SHAPE

from dice_ray.policy import families
from dice_ray.policy.logprobs import _score_noisy_states
from dice_ray.policy.model import block_mask, forward_hidden, prompt_blocks, response_blocks
from dice_ray.policy.tokenizer import DiceTokenizer

ENV = "DICE_SDAR_REMOTE_CODE"
_FILES = ("modeling_sdar.py", "configuration_sdar.py")
_DIR = os.environ.get(ENV, "")
pytestmark = pytest.mark.skipif(
    not _DIR or not all((Path(_DIR) / f).is_file() for f in _FILES),
    reason=f"{ENV} must name a folder holding {' and '.join(_FILES)} (SDAR's Hugging Face remote code)",
)

TOL = 1e-5
BS = TINY_FAMILY_SHAPE["block_size"]  # 4, SDAR's block length
ROPE_THETA = 1_000_000.0  # SDAR's (Qwen3's); not the 10000 default, so a dropped rope_theta shows


def _import_remote(folder: Path):
    """The remote ``configuration_sdar`` and ``modeling_sdar`` modules, imported as one package (its relative
    imports work). ``flash_attn`` needs no stub: the remote code imports it under ``try`` and falls back to SDPA."""
    name = "_sdar_remote_code"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        sys.modules[name] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{name}.configuration_sdar"), importlib.import_module(f"{name}.modeling_sdar")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(remote SDARForCausalLM, ours loaded by families.load_checkpoint from the remote's save_pretrained,
    tokenizer), fp32, eval mode, the same random weights."""
    conf, modeling = _import_remote(Path(_DIR))
    # Not math: the remote code lists tied weights transformers-4 style (a list); transformers >= 5 wants
    # {target: source}. Without this save_pretrained crashes; the tensors saved are the same.
    if isinstance(getattr(modeling.SDARForCausalLM, "_tied_weights_keys", None), list):
        modeling.SDARForCausalLM._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    tok = DiceTokenizer.load()
    shape = {k: v for k, v in TINY_FAMILY_SHAPE.items() if k != "block_size"}
    cfg = conf.SDARConfig(vocab_size=tok.vocab_size, rope_theta=ROPE_THETA, tie_word_embeddings=False,
                          pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, mask_token_id=tok.mask_id, **shape)
    torch.manual_seed(0)
    remote = modeling.SDARForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every tensor random (norm gains too), so a dropped or misnamed weight shows
        for name, p in remote.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)
    folder = tmp_path_factory.mktemp("sdar_remote") / "ckpt"
    remote.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_parameters", None)  # as released SDAR configs: rope_theta + rope_scaling only
    raw["rope_scaling"] = None
    (folder / "config.json").write_text(json.dumps(raw))
    tok.save(folder / "tokenizer.json")
    ours, _, mcfg = families.load_checkpoint(folder)
    assert mcfg.family == "sdar" and mcfg.rope_theta == ROPE_THETA
    return remote, ours.eval(), tok


def _remote_logits(remote, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Remote logits [B, q, V]: its own forward, ``mask`` BoolTensor[q, kv] as the 4-D mask it takes."""
    with torch.no_grad():
        return remote(input_ids=ids, attention_mask=mask[None, None], position_ids=pos[None].expand(ids.shape[0], -1),
                      use_cache=False).logits


def _our_logits(ours, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Our logits [B, q, V]: forward_hidden (the dice_block attention) + lm_head."""
    with torch.no_grad():
        return ours.lm_head(forward_hidden(ours, ids, pos, mask))


def _plain(P: int, R: int, bs: int, tok) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [1, P+R] with the last block masked, positions [P+R], our block-causal mask [P+R, P+R])."""
    gen = torch.Generator().manual_seed(P)
    ids = torch.randint(3, tok.vocab_size, (1, P + R), generator=gen)
    ids[0, P + R - bs:] = tok.mask_id
    rb, rpos = response_blocks(P, R, bs)
    blocks, clean = torch.cat([prompt_blocks(P, bs), rb]), torch.zeros(P + R, dtype=torch.long)
    return ids, torch.cat([torch.arange(P), rpos]), block_mask(blocks, clean, blocks, clean)


def test_plain_block_causal_sequence_same_logits(models):
    remote, ours, tok = models
    P, R = 6, 3 * BS  # a prompt that is not a multiple of the block length
    ids, pos, mask = _plain(P, R, BS, tok)
    diff = (_remote_logits(remote, ids, pos, mask) - _our_logits(ours, ids, pos, mask)).abs().max().item()
    assert diff <= TOL, f"max |logit difference| {diff:.3g} > {TOL}"
    _, _, wrong = _plain(P, R, BS // 2, tok)  # negative check: our side with block length 2
    bad = (_remote_logits(remote, ids, pos, mask) - _our_logits(ours, ids, pos, wrong)).abs().max().item()
    assert bad > 1e-2, f"a wrong block length changed the logits by only {bad:.3g}"
    blocks = torch.cat([prompt_blocks(P, BS), response_blocks(P, R, BS)[0]])
    clean = torch.zeros_like(blocks)
    ahead = block_mask(blocks, clean, blocks - (blocks > 0).long(), clean)  # negative: each block sees the next
    bad = (_remote_logits(remote, ids, pos, mask) - _our_logits(ours, ids, pos, ahead)).abs().max().item()
    assert bad > 1e-2, f"a mask one block ahead changed the logits by only {bad:.3g}"


def test_remote_generation_mask_equals_ours_for_a_one_block_prompt(models):
    remote, ours, tok = models
    P, R = BS, 3 * BS
    ids, pos, mask = _plain(P, R, BS, tok)
    theirs = remote._build_full_attention_mask(P, R, BS, torch.device("cpu"))
    assert torch.equal(theirs, mask)
    diff = (_remote_logits(remote, ids, pos, theirs) - _our_logits(ours, ids, pos, mask)).abs().max().item()
    assert diff <= TOL, f"max |logit difference| {diff:.3g} > {TOL}"


def test_remote_generation_mask_equals_ours_for_a_longer_prompt(models):
    """A prompt of 6: the remote's generation mask splits it into block-causal blocks aligned to its end,
    as ours does (prompt_blocks); the former dice-ray layout (the prompt one bidirectional block) does not."""
    remote, ours, tok = models
    P, R = 6, 3 * BS
    ids, pos, mask = _plain(P, R, BS, tok)
    theirs = remote._build_full_attention_mask(P, R, BS, torch.device("cpu"))
    assert torch.equal(theirs, mask)
    diff = (_remote_logits(remote, ids, pos, theirs) - _our_logits(ours, ids, pos, mask)).abs().max().item()
    assert diff <= TOL, f"max |logit difference| {diff:.3g} > {TOL}"
    old = mask.clone()
    old[:P, :P] = True  # negative: a bidirectional prompt
    bad = (_remote_logits(remote, ids, pos, theirs) - _our_logits(ours, ids, pos, old)).abs().max().item()
    assert bad > 1e-3, f"a bidirectional prompt changed the logits by only {bad:.3g}"


def _training_pair(P: int, R: int, tok, bs_remote: int = BS):
    """The remote ``x_t ‖ x_0`` inputs (ids [1, 2L], positions, its block_diff_mask) and the project's
    prompt ‖ clean response ‖ noisy response inputs (ids [1, P+2R], positions, block_mask), L = P + R."""
    _, modeling = _import_remote(Path(_DIR))
    gen = torch.Generator().manual_seed(7)
    L = P + R
    x0 = torch.randint(3, tok.vocab_size, (L,), generator=gen)
    masked = torch.zeros(L, dtype=torch.bool)
    masked[P:] = torch.rand(R, generator=gen) < 0.5
    masked[P] = True
    xt = torch.where(masked, torch.full_like(x0, tok.mask_id), x0)
    idx = torch.arange(2 * L)
    r_mask = modeling.block_diff_mask(None, None, idx[:, None], idx[None, :], block_size=bs_remote, n=L)
    r_in = (torch.cat([xt, x0])[None], torch.cat([torch.arange(L), torch.arange(L)]), r_mask)
    rb, rpos = response_blocks(P, R, BS)
    zp, zr = torch.zeros(P, dtype=torch.long), torch.zeros(R, dtype=torch.long)
    blocks, copies = torch.cat([prompt_blocks(P, BS), rb, rb]), torch.cat([zp, zr, zr + 1])
    o_in = (torch.cat([x0, xt[P:]])[None], torch.cat([torch.arange(P), rpos, rpos]),
            block_mask(blocks, copies, blocks, copies))
    return x0, xt, masked, r_in, o_in


@pytest.mark.parametrize("prompt_blocks_n", [1, 2])
def test_training_layout_xt_x0_same_logits(models, prompt_blocks_n):
    """The remote partitions the whole sequence into blocks from position 0, we align the prompt's blocks to
    its end and start the response blocks after it: for a prompt a multiple of the block length both
    partitions are the same."""
    remote, ours, tok = models
    P, R = prompt_blocks_n * BS, 3 * BS
    L = P + R
    _, _, _, (r_ids, r_pos, r_mask), (o_ids, o_pos, o_mask) = _training_pair(P, R, tok)
    theirs = _remote_logits(remote, r_ids, r_pos, r_mask)[0]
    mine = _our_logits(ours, o_ids, o_pos, o_mask)[0]
    diff_clean = (theirs[L:] - mine[:L]).abs().max().item()  # x_0 (prompt + clean response)
    diff_noisy = (theirs[P:L] - mine[L:]).abs().max().item()  # x_t response blocks
    assert max(diff_clean, diff_noisy) <= TOL, f"clean {diff_clean:.3g}, noisy {diff_noisy:.3g} > {TOL}"
    _, _, _, (_, _, wrong), _ = _training_pair(P, R, tok, bs_remote=2 * BS)  # negative: block length 8
    bad = (_remote_logits(remote, r_ids, r_pos, wrong)[0][P:L] - mine[L:]).abs().max().item()
    assert bad > 1e-2, f"a wrong block length changed the noisy logits by only {bad:.3g}"


@pytest.mark.parametrize("prompt_blocks_n", [1, 2])
def test_tracerl_scoring_path_matches_remote_logprobs(models, prompt_blocks_n):
    """The project's cached scoring path (prompt pass, clean pass, noisy pass; TraceRL / SFT) vs the remote's
    one x_t ‖ x_0 pass: log p(x_0 token) at every masked x_t position, the mask token excluded as in
    ``token_logits``."""
    remote, ours, tok = models
    P, R = prompt_blocks_n * BS, 3 * BS
    L = P + R
    x0, xt, masked, (r_ids, r_pos, r_mask), _ = _training_pair(P, R, tok)
    logits = _remote_logits(remote, r_ids, r_pos, r_mask)[0][:L].float()
    logits[:, tok.mask_id] = float("-inf")
    want = torch.log_softmax(logits, -1).gather(-1, x0[:, None])[:, 0][masked]
    with torch.no_grad():
        got = _score_noisy_states(ours, x0[:P], x0[None, P:], [(xt[None, P:], masked[None, P:])], BS, tok.mask_id)
    diff = (got[masked[None, P:]] - want).abs().max().item()
    assert diff <= TOL, f"max |log-prob difference| {diff:.3g} > {TOL}"
