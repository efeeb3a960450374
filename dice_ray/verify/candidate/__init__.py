"""The candidate stage: what a candidate is, read once, and how its formats compile.

:class:`~dice_ray.verify.candidate.candidate.Candidate` (``candidate.py``) is the candidate module read once at
:meth:`Verifier.verify <dice_ray.verify.verifier.Verifier.verify>`'s entry: its source, parse tree, format, dead
code and, for the load_inline format, its ``load_inline`` calls; every later stage reads it.

The fast format (``load_cuda``) compiles with NVRTC (``nvrtc.py``; its run time, loading and launching, is
:mod:`dice_ray.launch`, the module candidates import).  The load_inline format (KernelBench / DICE): its calls
read statically (``inline_spec.py``), the launch counters compiled into its CUDA source (``inline_counters.py``),
the generated files and light torch headers (``inline_files.py``), the compilers and their command lines
(``toolchain.py``), one compiler under hard limits (``limited_run.py``) and the compile pool with its cache
(``inline_build.py``); ``cuda_tree.py`` parses C++/CUDA with tree-sitter-cuda.  ``liveness.py`` finds the code
of a candidate that never runs.

Nothing here imports the later stages (rules, trials, sandbox, verdict, verifier).
"""
