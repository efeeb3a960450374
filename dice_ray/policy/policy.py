"""DiffusionPolicy: the diffusion LM (SDAR, LLaDA or Dream), its tokenizer and the ids the sampler and trainer need."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_file

from dice_ray.config import ModelConfig
from dice_ray.policy import families
from dice_ray.policy.families import build_model
from dice_ray.policy.tokenizer import ASSET_PATH, DiceTokenizer

_CONFIG_FILE = "model_config.json"
_WEIGHTS_FILE = "model.safetensors"
_TOKENIZER_FILE = "tokenizer.json"


class DiffusionPolicy:
    """A diffusion-LM policy of one family (``model_cfg.family``, :mod:`dice_ray.policy.families`) + tokenizer.

    Attributes:
        model: SDAR ``Qwen3ForCausalLM`` (block-causal), LLaDA ``LlamaForCausalLM`` or Dream
            ``Qwen2ForCausalLM`` (bidirectional), all with attention ``"dice_block"`` (``dice_ray.policy.model``).
        tokenizer: :class:`~dice_ray.policy.tokenizer.DiceTokenizer`, or a checkpoint folder's
            :class:`~dice_ray.policy.families.FolderTokenizer`.
        mask_id, eos_id, pad_id: ids of the mask token, end of sequence and padding.
        block_size: tokens a diffusion block (SDAR / DICE: 4; the bidirectional families' static schedule unit
            and infill growth step).
        family: ``"sdar"``, ``"llada"`` or ``"dream"``.
        logit_shift: 0, or 1 for Dream (the logits at ``i - 1`` predict the token at ``i``).
        model_cfg: the :class:`ModelConfig` the model was built from.

    Weight sync between actors: ``policy.state_dict()`` / ``policy.load_state_dict(sd)`` (the model's,
    fp32 or bf16 tensors keyed by parameter name).
    """

    def __init__(self, model, tokenizer: DiceTokenizer, model_cfg: ModelConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.model_cfg = model_cfg
        self.mask_id = tokenizer.mask_id
        self.eos_id = tokenizer.eos_id
        self.pad_id = tokenizer.pad_id
        self.block_size = model_cfg.block_size
        self.family = model_cfg.family
        self.logit_shift = families.logit_shift(model_cfg.family)

    @classmethod
    def build(cls, model_cfg: ModelConfig, seed: int = 0, tokenizer_path: str | Path = ASSET_PATH) -> "DiffusionPolicy":
        """A fresh, randomly initialised tiny policy with the shipped tokenizer (no download).

        The initial weights depend only on ``model_cfg``, the tokenizer and ``seed`` (the global torch RNG
        is left untouched).
        """
        tok = DiceTokenizer.load(tokenizer_path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_model(model_cfg, tok.vocab_size, tok.pad_id)
        return cls(model, tok, model_cfg)

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, seed: int = 0) -> "DiffusionPolicy":
        """``load(model_cfg.path, model_cfg)`` when a path is set, else ``build(model_cfg, seed)``."""
        return cls.load(model_cfg.path, model_cfg) if model_cfg.path else cls.build(model_cfg, seed)

    def save(self, path: str | Path) -> None:
        """Write ``model_config.json``, ``model.safetensors`` and ``tokenizer.json`` into folder ``path``.

        A policy loaded from a checkpoint folder (a :class:`~dice_ray.policy.families.FolderTokenizer`) is written
        back in its family's checkpoint format instead (:meth:`save_checkpoint`).
        """
        from dice_ray.policy.families import FolderTokenizer

        if isinstance(self.tokenizer, FolderTokenizer):
            self.save_checkpoint(path)
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / _CONFIG_FILE).write_text(self.model_cfg.model_dump_json(indent=2))
        save_file(_contiguous_cpu_state(self.model), str(path / _WEIGHTS_FILE), metadata={"format": "pt"})
        self.tokenizer.save(path / _TOKENIZER_FILE)

    def save_checkpoint(self, path: str | Path) -> None:
        """Write the policy as a checkpoint folder in its family's own format (SDAR / LLaDA / Dream ``config.json``,
        tensor names and ``tokenizer.json``; :func:`dice_ray.policy.families.save_checkpoint`)."""
        families.save_checkpoint(self.model, self.tokenizer, self.family, path)

    @classmethod
    def load(cls, path: str | Path, model_cfg: ModelConfig | None = None) -> "DiffusionPolicy":
        """Load a policy written by :meth:`save`, an SDAR / LLaDA / Dream checkpoint folder or hub id, or the newest
        checkpoint's policy of a ``dice-ray train`` run directory (:func:`run_policy`).

        A folder with ``model_config.json`` is this project's format (``model_cfg`` is not read); one with only a
        ``config.json`` is a checkpoint loaded by :func:`dice_ray.policy.families.load_checkpoint` (``model_cfg``
        gives the expected family, block size and dtype). A Hugging Face Hub id (``org/name[@revision]``) is
        resolved to its cached or downloaded snapshot first (:func:`~dice_ray.policy.families.resolve_checkpoint`).

        Raises:
            FileNotFoundError / ValueError: what :meth:`check_path` refuses (run first, with the same words), and
                :func:`~dice_ray.policy.families.load_checkpoint`'s tensor and token errors.
        """
        path = cls.check_path(path, model_cfg)
        if not (path / _CONFIG_FILE).is_file():
            model, tok, cfg = families.load_checkpoint(path, model_cfg)
            return cls(model, tok, cfg)
        cfg = ModelConfig.model_validate(json.loads((path / _CONFIG_FILE).read_text()))
        tok = DiceTokenizer.load(path / _TOKENIZER_FILE)
        model = build_model(cfg, tok.vocab_size, tok.pad_id)
        load_model(model, str(path / _WEIGHTS_FILE))
        return cls(model, tok, cfg.model_copy(update={"path": str(path)}))

    @staticmethod
    def check_path(path: str | Path, model_cfg: ModelConfig | None = None) -> Path:
        """The folder :meth:`load` reads for ``path``, checked without reading weights: a driver calls this on
        ``model.path`` before it starts any actor, so a broken folder is one error naming every problem, not a
        traceback from every actor.

        ``path`` may be a ``dice-ray train`` run directory (its newest checkpoint's policy, :func:`run_policy`), a
        folder with ``model_config.json`` (this project's three files and a valid model config), one with
        ``config.json`` (:func:`~dice_ray.policy.families.check_checkpoint_folder`) or a hub id (resolved first,
        :func:`~dice_ray.policy.families.resolve_checkpoint`).

        Raises:
            FileNotFoundError: ``path`` is neither an existing folder nor a hub id that can be had, is a run
                directory with no checkpoint, is neither format, or lacks one of its format's files (the message
                also names a bad config beside them).
            ValueError: a ``model_config.json`` or ``config.json`` that does not parse or names an unknown or
                other family (the message names the file and the field).
        """
        path = families.resolve_checkpoint(run_policy(path))
        if not path.is_dir():
            raise FileNotFoundError(f"model path {path}: not a folder")
        if not (path / _CONFIG_FILE).is_file():
            if families.is_checkpoint_folder(path):
                families.check_checkpoint_folder(path, model_cfg)
                return path
            raise FileNotFoundError(
                f"model path {path}: neither a dice-ray policy folder ({_CONFIG_FILE}, {_WEIGHTS_FILE}, "
                f"{_TOKENIZER_FILE}: dice-ray sft --out, a run's checkpoints/step_*/policy), a dice-ray run directory "
                f"(checkpoints/step_*/policy) nor an SDAR / LLaDA / Dream checkpoint folder (config.json, "
                f"*.safetensors, tokenizer.json)")
        missing = [f for f in (_WEIGHTS_FILE, _TOKENIZER_FILE) if not (path / f).is_file()]
        problems = [f"missing {', '.join(missing)}"] if missing else []
        try:
            ModelConfig.model_validate_json((path / _CONFIG_FILE).read_text())
        except ValueError as e:  # pydantic's ValidationError (JSON syntax included) is a ValueError
            lines = [x.strip() for x in str(e).splitlines()]
            said = [x for x in lines[1:] if x and not x.startswith("For further information")][:2] or lines[:1]
            problems.append(f"{_CONFIG_FILE} is not a valid model config ({'; '.join(said)})")
        if problems:
            raise (FileNotFoundError if missing else ValueError)(f"policy folder {path}: {'; '.join(problems)}")
        return path

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> "DiffusionPolicy":
        """Move the model to ``device``; returns self."""
        self.model.to(device)
        return self

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens dropped."""
        return self.tokenizer.decode(ids)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers (for weight sync)."""
        return self.model.state_dict()

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights produced by :meth:`state_dict` (strict)."""
        self.model.load_state_dict(state_dict)

    def num_parameters(self) -> int:
        """Number of distinct parameters (tied embeddings counted once)."""
        return sum(p.numel() for p in self.model.parameters())


def _contiguous_cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as standalone CPU copies, tied tensors (same storage and view) kept once.

    DeepSpeed ZeRO flattens parameters into one buffer, so they are views that
    ``safetensors.torch.save_model`` refuses to save; :func:`safetensors.torch.load_model` restores the
    ties on load.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in model.state_dict().items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def run_policy(path: str | Path) -> str | Path:
    """The policy folder a ``dice-ray train`` run directory stands for (``checkpoints/`` and no policy of its own):
    its newest checkpoint's (``checkpoints/step_NNNNNN/policy``); anything else, a ``dice-ray sft --out`` folder
    included (its final policy beside its ``checkpoints/``) or a hub id, is returned as it is.

    Raises:
        FileNotFoundError: a run directory with no checkpoint that holds a policy.
    """
    ckpts = Path(path) / "checkpoints"
    if not ckpts.is_dir() or any((Path(path) / f).is_file() for f in (_CONFIG_FILE, "config.json")):
        return path
    policies = sorted(ckpts.glob("step_*/policy"))
    if not policies:
        raise FileNotFoundError(f"model path {path}: a dice-ray run directory with no checkpoint holding a policy "
                                f"({ckpts}/step_*/policy)")
    return policies[-1]
