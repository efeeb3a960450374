"""The static rules stage: a candidate's parse tree and sources judged before anything runs.

``check.py`` (:func:`~dice_ray.verify.rules.check.check_candidate`, the stage's entry) applies the Python rules
(``python_rules.py``, on :mod:`ast`), the C++/CUDA rules of a load_inline candidate's sources (``cpp_rules.py``,
on tree-sitter-cuda) and the CUDA text rules (``cuda_text.py``: library headers, files read by path); the
rules' ids, verdicts and reports are ``catalog.py``; what a candidate may import and call, shared with the
worker's import guard, is ``allowlist.py``.

Reads :mod:`dice_ray.verify.candidate` only; the later stages (trials, sandbox, verdict, verifier) import it.
"""
