"""The policy's byte-level BPE tokenizer (trained with HF ``tokenizers``) and its special tokens.

Special tokens (ids fixed by training order):

* ``<|pad|>`` (id 0): padding, never a training target.
* ``<|mask|>`` (id 1): the diffusion mask token (SDAR's ``<MASK>``); a masked position's logits predict
  the token at that position.
* ``<|eos|>`` (id 2): end of a completion; sampling stops after the block holding it.

The tokenizer ships as ``dice_ray/policy/assets/tokenizer.json``. Regenerate it (when the built-in
suite changes) with::

    python -m dice_ray.policy.tokenizer --retrain [--vocab-size 4096] [--extra PATH.json ...]

The shipped file was made with ``--extra /work/shared/data/dice`` (DICE's JSON, for coverage of CUDA
and KernelBench code beyond the suite).

The corpus is every file under ``dice_ray/tasks/builtin/`` plus, when ``dice_ray.tasks`` can load the
built-in suite, every infill / end-to-end prompt and SFT target; ``--extra`` adds DICE JSON files
(``pytorch_code``, ``cuda_code``, ``prefix``, ``middle``, ``suffix`` fields).  Built-in texts are
repeated so that they make up at least half of the corpus: the tiny policy must memorize them, and
fewer tokens a solution make that easier.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
EOS_TOKEN = "<|eos|>"
SPECIAL_TOKENS = (PAD_TOKEN, MASK_TOKEN, EOS_TOKEN)

ASSET_PATH = Path(__file__).resolve().parent / "assets" / "tokenizer.json"
BUILTIN_DIR = Path(__file__).resolve().parents[1] / "tasks" / "builtin"

# Always part of the corpus, so a fresh checkout with an empty suite still trains a usable tokenizer:
# the fast candidate format of INTERFACES.md and a KernelBench-style reference.
_SEED_TEXT = r'''import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        return y


class Model(nn.Module):
    """Simple model that performs a ReLU activation."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


batch_size = 16
dim = 16384


def get_inputs():
    x = torch.randn(batch_size, dim)
    return [x]


def get_init_inputs():
    return []
'''


class DiceTokenizer:
    """A thin wrapper of :class:`tokenizers.Tokenizer` with the policy's special-token ids.

    Attributes:
        pad_id, mask_id, eos_id: ids of ``<|pad|>``, ``<|mask|>``, ``<|eos|>``.
        vocab_size: number of ids (specials included).
    """

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        # text that spells a special token ("<|mask|>" in a prompt) stays text: only the sampler and
        # trainer place special ids
        tok.encode_special_tokens = True
        ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
        if any(i is None for i in ids):
            raise ValueError(f"tokenizer lacks a special token: needs all of {SPECIAL_TOKENS}")
        self.pad_id, self.mask_id, self.eos_id = ids
        self.vocab_size: int = tok.get_vocab_size()

    @classmethod
    def load(cls, path: str | Path = ASSET_PATH) -> "DiceTokenizer":
        """Load a ``tokenizer.json``. Raises FileNotFoundError when ``path`` does not exist."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer file {path} does not exist (run python -m dice_ray.policy.tokenizer --retrain)"
            )
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` to ``path``."""
        self._tok.save(str(path))

    def to_json(self) -> str:
        """The tokenizer serialized as JSON text (used for cache keys)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; never a special id (text spelling ``<|mask|>`` is encoded as text)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens (pad, mask, eos) are dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _builtin_texts() -> list[str]:
    texts = [p.read_text() for p in sorted(BUILTIN_DIR.rglob("*.py"))] if BUILTIN_DIR.is_dir() else []
    try:  # prompts and targets exactly as the policy will see them
        from dice_ray.tasks.loaders import load_tasks
        from dice_ray.tasks.prompts import sft_pairs

        for task in load_tasks("builtin").tasks:
            for prompt, target in sft_pairs(task):
                texts += [prompt, target]
    except Exception as exc:  # the suite may not exist yet; the files above still count
        print(f"[tokenizer] prompts of the built-in suite unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
    return texts


def _extra_texts(paths: list[str]) -> list[str]:
    texts: list[str] = []
    for p in paths:
        files = sorted(Path(p).glob("*.json")) if Path(p).is_dir() else [Path(p)]
        for f in files:
            for rec in json.loads(f.read_text()):
                texts += [rec[k] for k in ("pytorch_code", "cuda_code", "prefix", "middle", "suffix")
                          if isinstance(rec.get(k), str) and rec[k]]
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = 4096, max_token_length: int = 16) -> DiceTokenizer:
    """Train a byte-level BPE tokenizer on ``texts``.

    Pre-tokenization splits only at newlines (a token never spans two lines), so merges may cross
    spaces and punctuation within a line (``"    long i = "``); ``max_token_length`` (bytes) keeps
    tokens sub-line fragments. On the built-in suite this gives ~9 characters a token against ~3
    with GPT-2's word-level split: 3x shorter sequences for the tiny policy to learn and sample.

    Raises:
        ValueError: ``texts`` is empty or ``vocab_size`` < 300 (256 bytes + specials + some merges).
    """
    if not texts:
        raise ValueError("texts: need at least one training text")
    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 300")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_length,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return DiceTokenizer(tok)


def retrain(vocab_size: int = 4096, extra: list[str] | None = None, out: Path = ASSET_PATH) -> DiceTokenizer:
    """Retrain the shipped tokenizer on the built-in suite (+ ``extra`` DICE JSON) and write ``out``."""
    builtin = [_SEED_TEXT] + _builtin_texts()
    others = _extra_texts(extra or [])
    b_chars, o_chars = sum(map(len, builtin)), sum(map(len, others))
    repeat = max(1, -(-o_chars // max(b_chars, 1)))  # built-in texts >= half the corpus
    tok = train_tokenizer(builtin * repeat + others, vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(out)
    print(f"[tokenizer] {len(builtin)} built-in texts ({b_chars} chars, x{repeat}), {len(others)} extra texts "
          f"({o_chars} chars) -> vocab {tok.vocab_size}, wrote {out}")
    return tok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--retrain", action="store_true", help="train and write dice_ray/policy/assets/tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--extra", nargs="*", default=[], help="DICE JSON files or folders to add to the corpus")
    args = ap.parse_args(argv)
    if not args.retrain:
        ap.error("nothing to do: pass --retrain")
    tok = retrain(args.vocab_size, args.extra)
    sample = _SEED_TEXT
    print(f"[tokenizer] seed text: {len(sample)} chars -> {len(tok.encode(sample))} tokens")


if __name__ == "__main__":
    main()
