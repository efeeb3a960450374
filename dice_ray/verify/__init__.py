"""dice_ray.verify: compile, static anti-cheat rules, sandboxed run, correctness, timing, reward.

Entry points: :class:`dice_ray.verify.verifier.Verifier` (``verify(task, src, id) -> Verdict``),
:func:`dice_ray.verify.reward.compute_reward`, :func:`dice_ray.verify.command.verify_files`.

Modules: ``verdict`` (the typed result), ``rules`` (static rules, ast), ``correctness`` (output
comparison), ``harness`` (what the worker does: stages, run-time rules, timing), ``worker`` (the
sandboxed process), ``runner`` (its parent side: spawn, protocol, timeouts), ``sandbox``
(rlimits, environment), ``confine`` (what the kernel enforces: Landlock, seccomp), ``protocol`` (JSON
frames), ``reward``, ``command``; the
load_inline (KernelBench / DICE) format: ``inline`` (static extraction, launch counts, worker-side
loading), ``inline_build`` (the compile pool and its cache), ``inline_compile`` (launch counters,
generated files, light headers, limited compiler processes), ``inline_rules`` (C++/CUDA rules).
Nothing here imports Ray: the verifier runs the same inside a Ray actor or a plain process.

Built on KernelBench's evaluation (``src/kernelbench/eval.py``, ``timing.py``) and closes its
known gaps: one bad kernel poisoning the evaluating process (here: a separate worker, killed and
replaced after a crash, timeout or sticky CUDA error); zero / near-zero outputs passing an
absolute tolerance (scaled atol); reused freed output buffers and unwritten elements (free
memory poisoned with NaN, candidate run before the reference); input mutation; side streams,
threads and patched timers (static rules, timing through pre-bound CUDA events on the launch
stream); torch fallbacks (static rules + a dispatch-mode op check); decoy kernels (launch counter
on every call); answers computed by the copy ops forward may run beside a kernel that does nothing
(a kernel ablation: one call with the candidate's kernels counted but not run, its host reads
answered as in the real call before it, so a flag its kernel sets does not tell it); behaviour that
changes after the correctness phase (a launch check on every timed call and a final comparison
after timing).

Known gaps: a kernel that writes out of bounds without faulting can corrupt later candidates in the
same worker; RLIMIT_AS is not set on GPU workers (CUDA reserves huge ranges); timing is device time
between CUDA events on the launching stream (``timing``): work on another stream that ends within
5-10 us of a window's stream end goes untimed; the dispatch-mode op check runs only in the
correctness trials and the dry run (the launch check runs on every call, the import guard always);
the kernel ablation only sees a kernel that does nothing the outputs need: one that writes a single
element of an answer copied by torch passes it (host reads through aten ops are replayed in it; the
other ways for a kernel to reach the host, pinned, mapped or managed memory and device-to-host
``cudaMemcpy``, are static rule ``host-memory``, pinned allocations also a run-time one).
"""
