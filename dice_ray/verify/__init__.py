"""dice_ray.verify: a candidate read, judged by static rules, run in a sandboxed worker, timed, rewarded.

Entry points: :class:`dice_ray.verify.verifier.Verifier` (``verify(task, src, id) -> Verdict``),
:func:`dice_ray.verify.reward.compute_reward`, :func:`dice_ray.verify.command.verify_files`.

The package has the shape of the pipeline, a folder a stage:

* ``candidate/``: the candidate read once (:class:`~dice_ray.verify.candidate.candidate.Candidate`: source,
  parse tree, format, dead code, load_inline specs), and the formats' compilers (NVRTC for ``load_cuda``; the
  load_inline build: counters, files, toolchain, limited compilers, the compile pool);
* ``rules/``: the static rules (Python, C++/CUDA, CUDA text; the catalog of rule ids; the allow-lists);
* ``trials/``: what the sandboxed worker does with a job (source execution and the import guard, the
  reference, correctness trials, kernel ablation, precision check, compile-only dry run, timing, self-test);
* ``sandbox/``: the worker process and its parent side (runner, fork server, protocol, environment, rlimits,
  Landlock / seccomp, kernel preload);
* ``verdict.py`` (the typed result), ``reward.py`` (verdict -> reward);
* ``facts_book.py`` (the references' facts a Verifier keeps) and ``verifier.py`` (the orchestrating
  :class:`~dice_ray.verify.verifier.Verifier`);
* ``command.py`` (``dice-ray verify``).

Layers: imports flow one way, each layer importing only the layers before it (and itself):
``candidate -> rules -> trials -> sandbox -> verdict, reward -> facts_book, verifier -> command``.
:mod:`dice_ray.launch` (outside the package: the module fast-format candidates import) is the fast format's run
time between ``candidate`` (its NVRTC compile) and ``trials`` (which count its launches); no module of
``candidate`` or ``rules`` imports it.  ``tests/test_verify_layers.py`` checks the order and that no import
cycle exists.  Nothing here imports Ray: the verifier runs the same inside a Ray actor or a plain process.

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
between CUDA events on the launching stream (``trials/timing.py``): work on another stream that ends within
5-10 us of a window's stream end goes untimed; the dispatch-mode op check runs only in the
correctness trials and the dry run (the launch check runs on every call, the import guard always);
the kernel ablation only sees a kernel that does nothing the outputs need: one that writes a single
element of an answer copied by torch passes it (host reads through aten ops are replayed in it; the
other ways for a kernel to reach the host, pinned, mapped or managed memory and device-to-host
``cudaMemcpy``, are static rule ``host-memory``, pinned allocations also a run-time one).
"""
