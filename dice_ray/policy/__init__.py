"""dice_ray.policy: the block-diffusion policy (SDAR shape), its sampler, RL log-prob estimators and SFT warm start.

Modules (import from them directly; importing this package does not load torch or transformers):

* ``tokenizer``: byte-level BPE with ``<|pad|>``, ``<|mask|>``, ``<|eos|>``
  (``python -m dice_ray.policy.tokenizer --retrain``).
* ``model``: Qwen3ForCausalLM with block-causal attention, the ``x_t ‖ x_0`` mask rule, KV cache.
* ``families``: SDAR / LLaDA / Dream on transformers-native classes, checkpoint folders (LLaDA's names renamed).
* ``policy``: :class:`DiffusionPolicy` (build / save / load / encode / decode / state_dict).
* ``samples``: what the sampler returns (:class:`Rollout`, :class:`RolloutGroup`, :class:`SampleStats`), plain data.
* ``sampler``: :func:`sample_group` (block diffusion, static / dynamic low-confidence remasking; LLaDA / Dream
  whole-response decoding), :func:`sample_groups` (several SDAR groups in one batch) and :func:`infill_group`
  (prefix / suffix infilling, bidirectional families).
* ``task_sampling``: :func:`sample_task_group` / :func:`sample_task_groups` (a worker's call, SDAR groups batched), a
  task and phase posed as the family decodes it (SDAR: the scaffold in the prompt; LLaDA / Dream infill: the span
  between the scaffold's two sides), for rollouts and eval alike.
* ``logprobs``: :func:`response_logprobs` (TraceRL / coupled-GRPO / diffu-GRPO log-probs, ``rl.logprob_estimator``).
* ``sft_loss``: :func:`diffusion_loss`, the masked-diffusion SFT loss of each family.
* ``sft_batches``: SFT pairs to token ids, and an epoch's batches of similar length.
* ``sft_optim``: the SFT lr schedule (warm-up, cosine) and gradient clipping as DeepSpeed does it.
* ``sft_run``: :class:`SFTRun`, one SFT run as a resumable state (plain torch or a DeepSpeed engine).
* ``sft_warm_start``: :func:`warm_start`, the trainer's warm start (masked-diffusion SFT, cached by content hash).
* ``sft``: :func:`run_sft`, the ``dice-ray sft`` command.
* ``deepspeed_setup``: ``deepspeed.initialize`` without JIT-built ops on a CPU, a one-rank group, the SFT engine
  (the RL learner and ``dice-ray sft`` use it).
"""
