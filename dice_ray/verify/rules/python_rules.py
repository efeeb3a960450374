"""The Python rules: static anti-cheat rules on a candidate's parse tree, applied before anything runs.

The candidate format is INTERFACES.md's fast format: a Python module that compiles CUDA with
``dice_ray.launch.load_cuda`` and whose ``ModelNew.forward`` launches those kernels.  These rules
close the fallbacks and tricks that KernelBench's evaluator lets through (DESIGN.md's list of known
cheats; KernelBench's own ``kernel_static_checker.py`` is regex-based and opt-in).  The run-time
rules (kernel launched on every call, outputs that need the kernels, torch ops seen by a dispatch
mode, input mutation, output type) are enforced by the trials (:mod:`dice_ray.verify.trials`) in the sandbox.

Decisions (documented so prompts can state them):

* Imports: only :data:`~dice_ray.verify.rules.allowlist.ALLOWED_IMPORTS` (``torch``, ``torch.nn``, ``torch.nn.functional``,
  ``torch.nn.init`` / ``modules.utils`` / ``parameter``, ``math``, ``typing``, ``itertools``, ``collections``,
  ``numbers``, ``__future__``, ``dice_ray.launch`` for :data:`ALLOWED_LAUNCH_NAMES`; each entry's reason is beside
  it).  ``torch.nn.functional`` and ``torch.nn.init`` may be imported (``__init__`` may use anything in torch to
  build parameters that match the reference) but their functions are refused in run-time code; itertools'
  functions that call what they are handed are judged as ``map`` is (``CALLABLE_ARGUMENTS``).
* Code that never runs is not judged (:mod:`dice_ray.verify.candidate.liveness`): a function nothing live calls (a
  copy of ``get_inputs``), an ``if __name__ == "__main__":`` block, the imports only they use.
* Construction code is ``__init__`` (of a class no run-time code builds) and every function or method reachable
  only from it (``self.reset_parameters()``, ``self._make_layer()``: :func:`~dice_ray.verify.candidate.liveness.
  construction_code`); torch may be used freely there.  "Run-time code" is every other function and lambda (a
  method also called from forward, handed to a hook or named in a string among them): there only
  :data:`ALLOWED_TORCH_CALLS` (allocation, meta queries, ``torch.Tensor()`` with no data) and
  :data:`ALLOWED_TENSOR_METHODS` (views, sizes, pointers, in-place fills) may be called on torch; a cast is
  judged as the ``.to`` it is (``x.float()`` is ``x.to(torch.float32)``): one to float32, float64 or one of the
  task's input dtypes (``.double()`` on a float64 task, ``.long()`` on int64 indices) is left to the run-time op
  check, which refuses one that converts; a cast to any other dtype the rules read (``.half()``, ``.long()``,
  ``.to(torch.float16)`` on a float32 task) is refused; ``@`` is refused;
  submodules (``self.conv(x)``) and ``.forward`` may not be called; ``next()`` may not advance an iterator kept on
  ``self`` (a call counter).
* ``torch.autograd.Function`` wrappers: a module-level class deriving only from ``torch.autograd.Function`` (or from
  such a class of the candidate), not ``ModelNew``, its name bound once; run-time code may call ``X.apply(...)`` (or a
  module-level ``f = X.apply``), and its methods are run-time code (``forward``, ``backward``, ``setup_context``...:
  :func:`_reserved_names`, never construction code).  The ctx torch hands them may be used only for
  :data:`_CTX_API` (``save_for_backward``, ``saved_tensors``, ``needs_input_grad``...) and the fields the candidate
  stores on it (``ctx.alpha = alpha``: a per-call object, no state across calls); its other attributes (the autograd
  graph's: ``next_functions``) and ctx as a value are ``dynamic-code``, a private attribute of the wrapper class that
  the candidate did not define (``X._backward_cls``) too.  Any other base (``InplaceFunction``, Function with
  nn.Module) is ``base-class``.
* ``getattr`` only as ``getattr(self or self.<attr>, name)`` reading a parameter, buffer or submodule: ``name`` a
  constant string or one beginning with a constant no method or torch attribute name begins with
  (``"weight_ih_l" + suffix``), its value never called; the worker's ``getattr`` checks it again.
* No state across calls: run-time code may not assign ``self.<x>``, use ``global``/``nonlocal``,
  mutate module-level containers or use mutable default arguments; module top level holds only
  imports, defs, classes and constant (or ``load_cuda(...)``) assignments (``D, H, W = 16, 32, 32`` too).
* No way out through attributes, ``__init__`` included: an import-rooted path that reaches a module
  outside the allow-list (``torch.os``, ``typing.sys``: ``forbidden-import``) or a torch internal,
  torch's file I/O (``torch.load``/``save``/``from_file``: ``file-access``), a module used as a value
  (``t = torch``, ``F = torch.nn.functional``) or frame attributes (``gen.gi_frame.f_back``:
  ``dynamic-code``); ``str.format`` templates must be strings the rules can read, and their fields
  may not walk private or frame attributes (``'{0.__globals__}'``: ``dynamic-code``).
* No code in strings: ``typing.get_type_hints`` / ``ForwardRef._evaluate`` (string annotations run as
  code) and typing's private helpers are ``dynamic-code``, as are torch calls returning a module
  (``torch.get_device_module``, ``torch.cuda.cudart``).
* Only ``self``'s attributes may be assigned (``m = nn.Module; m._call_impl = f``, ``type(x).relu = f``:
  ``patching``), never ``self.<method>`` (``self.forward = torch.relu``); run-time code may not use
  ``self`` as a value (``s = self; s.cache = y``: ``forward-state``).  Process-wide torch hooks and
  settings (``nn.modules.module.register_module_forward_hook``, any ``torch.*.set_*``) are
  ``patching``, called or taken as values.
* No torch op or submodule under another name: outside ``__init__`` a torch function may not be taken
  as a value (``R = torch.relu`` at top level or in a class body, ``map(F.gelu, xs)``,
  ``forward = nn.ReLU.forward``) nor, in run-time code, a tensor's compute method (``f = y.relu``):
  ``forward-torch-op``; run-time code may call only builtins, imports (checked by name), the
  candidate's functions, classes and lambdas, and kernels (also through a name bound only to kernels,
  or a parameter given a kernel at every call): a variable, parameter, subscript or call result
  (``act = self.act; act(x)``, ``self._modules['act'](x)``), ``nn.Module`` or private methods
  (``._call_impl``) and callables handed to ``map``/``filter``/``key=`` are ``forward-module-call``.

The load_inline format (KernelBench / DICE: ``ext = load_inline(...)`` at top level, ``ModelNew``
calling ``ext.<function>``) is detected (:attr:`Candidate.format <dice_ray.verify.candidate.candidate.Candidate.format>`)
and gets the same Python rules, with ``torch.utils.cpp_extension``'s ``load_inline`` allowed and ``ext.<function>``
calls counting as kernel launches; its C++/CUDA sources get the rules of :mod:`dice_ray.verify.rules.cpp_rules`
(``cpp-torch-op`` and the CUDA-side rules, on a tree-sitter parse).

``cuda-library`` (cuBLAS, cuDNN, CUTLASS, thrust...) is a cheat unless
``VerifyConfig.allow_vendor_libraries`` is set, and then only for the load_inline format
(:func:`check_candidate(..., allow_vendor_libraries=True) <dice_ray.verify.rules.check.check_candidate>`):
NVRTC cannot link host libraries, so the
fast format keeps the rule.

Each rule has an id (:data:`~dice_ray.verify.rules.catalog.RULES`); a
:class:`~dice_ray.verify.rules.catalog.Violation` names the rule, the line and what was seen.
"""

from __future__ import annotations

import ast
import functools
import re
import types

from dice_ray.tasks.sizing import CAST_METHODS
from dice_ray.verify.candidate.candidate import Candidate
from dice_ray.verify.candidate.liveness import DeadCode, construction_code
from dice_ray.verify.rules.allowlist import (ALLOWED_IMPORTS, ALLOWED_LAUNCH_NAMES, ALLOWED_TENSOR_METHODS,
                                             ALLOWED_TORCH_CALLS, CALLABLE_ARGUMENTS, import_allowed)
from dice_ray.verify.rules.catalog import StaticReport, Violation

__all__ = ["check_python"]

_STREAM_NAMES = frozenset(
    {"Stream", "stream", "Event", "graph", "graphs", "CUDAGraph", "make_graphed_callables", "ExternalStream",
     "set_stream", "current_stream", "default_stream", "StreamContext", "_sleep", "graph_pool_handle"}
)
_INTERNAL_ROOTS = ("torch.ops", "torch.compile", "torch.jit", "torch.backends", "torch.library",
                   "torch.utils", "torch.cuda.jiterator", "torch.fx", "torch.export", "torch.distributed",
                   "torch.multiprocessing", "torch.classes", "torch.hub", "torch.overrides", "torch.func")
#: torch functions that change process-wide state the reference shares: settings (``set_*`` in any torch
#: module), seeds, and registries that every module or op consults (``nn.modules.module.
#: register_module_forward_hook`` runs the candidate's hook on the reference's forward too;
#: ``register_flash_attention_impl``, GEMM tuning); refused called or taken as a value (``patching``)
_GLOBAL_SETTERS = re.compile(r"^torch\.(cuda\.)?(set_\w+|manual_seed\w*|seed|use_deterministic_algorithms|"
                             r"random\.\w+|cuda\.memory\.\w+|cuda\.empty_cache)$|"
                             r"^torch\.(\w+\.)*(set_\w+|register_module_\w+|register_\w+_(impl|hook)|"
                             r"register_event_handler|register_pytree_node|register_kl)$|^torch\.cuda\.tunable\.\w+$")
_FORBIDDEN_BUILTINS = {
    "eval": "dynamic-code", "exec": "dynamic-code", "compile": "dynamic-code", "__import__": "dynamic-code",
    "getattr": "dynamic-code", "setattr": "dynamic-code", "delattr": "dynamic-code", "globals": "dynamic-code",
    "locals": "dynamic-code", "vars": "dynamic-code", "breakpoint": "dynamic-code", "input": "dynamic-code",
    "help": "dynamic-code", "memoryview": "dynamic-code", "exit": "dynamic-code", "quit": "dynamic-code",
    "open": "file-access",
}
_MUTATORS = frozenset({"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add",
                       "discard", "remove", "register_buffer", "register_parameter", "add_module", "copy_"})
_ALLOWED_DUNDERS = frozenset({"__init__", "__name__"})
_ALLOWED_DECORATORS = frozenset({"staticmethod", "classmethod", "property", "torch.no_grad", "torch.inference_mode",
                                 "torch.autograd.function.once_differentiable"})
#: the base of a ``torch.autograd.Function`` wrapper (``X.apply(...)`` runs ``X.forward``), by its import paths
_FUNCTION_BASES = frozenset({"torch.autograd.Function", "torch.autograd.function.Function"})
#: the methods torch calls on a Function wrapper with its ctx first (``forward`` only when there is no
#: ``setup_context``: then ``forward(*args)`` and ``setup_context(ctx, inputs, output)``)
_CTX_METHODS = frozenset({"forward", "backward", "setup_context", "jvp", "vjp"})
#: what a Function's ctx may be used for, besides the fields the candidate stores on it (``ctx.alpha = alpha``):
#: saving tensors and flags for backward; its other attributes are the autograd graph's (``next_functions``,
#: ``register_hook``, ``metadata``)
_CTX_API = frozenset({"save_for_backward", "save_for_forward", "saved_tensors", "needs_input_grad", "mark_dirty",
                      "mark_non_differentiable", "set_materialize_grads"})
_STR_METHODS = frozenset({"format", "replace", "strip", "lstrip", "rstrip", "join", "upper", "lower"})
#: tensor methods that are ``.to(<dtype>)`` under another name (``x.float()`` is ``x.to(torch.float32)``), judged as
#: that ``.to`` is (:meth:`_Checker.check_cast`); on ``self`` (a module: it converts every parameter in place) they
#: stay refused, as ``self.<any module method>()`` is (:data:`dice_ray.tasks.sizing.CAST_METHODS`, which also reads a
#: reference's inputs' dtypes)
_CAST_METHODS = CAST_METHODS
#: cast targets left to the run-time op check whatever the task: a cast to them cannot lower precision, and one that
#: converts (its input another dtype) is the aten ``_to_copy`` that check refuses (:meth:`_Checker.check_cast`)
_WIDE_DTYPES = frozenset({"float32", "float64"})



def _dice_ray_use_ok(dotted: str) -> bool:
    """Whether an import-rooted name may be used: of dice_ray only ``dice_ray.launch.<name>`` for the
    :data:`ALLOWED_LAUNCH_NAMES` (``import dice_ray.launch`` is allowed, and ``dice_ray.launch.configure``
    would turn the worker's CUDA source check off)."""
    parts = dotted.split(".")
    return parts[0] != "dice_ray" or (parts[:2] == ["dice_ray", "launch"] and len(parts) > 2
                                      and parts[2] in ALLOWED_LAUNCH_NAMES)


def _dice_ray_use_message(dotted: str) -> str:
    return (f"uses {dotted}: of dice_ray a candidate may use only dice_ray.launch's "
            f"{', '.join(sorted(ALLOWED_LAUNCH_NAMES))} (the others configure the verifier)")



_TENSOR_ATTRS: frozenset[str] | None = None


def _tensor_compute_methods() -> frozenset[str]:
    global _TENSOR_ATTRS
    if _TENSOR_ATTRS is None:
        import torch

        _TENSOR_ATTRS = frozenset(n for n in dir(torch.Tensor) if not n.startswith("_")) - ALLOWED_TENSOR_METHODS
    return _TENSOR_ATTRS


@functools.cache
def _tensor_method_names() -> frozenset[str]:
    """Compute methods of ``torch.Tensor`` (callables, not properties such as ``shape``/``dtype``): a
    reference to one (``f = y.relu``) is a torch op taken as a value."""
    import inspect

    import torch

    return frozenset(n for n in _tensor_compute_methods()
                     if not isinstance(inspect.getattr_static(torch.Tensor, n, None), (property, types.GetSetDescriptorType,
                                                                                         types.MemberDescriptorType)))


@functools.cache
def _module_method_names() -> frozenset[str]:
    """Names that call into a ``torch.nn.Module`` (``forward``, ``_call_impl``, ``_conv_forward``,
    ``apply``...): ``nn.Module``'s public methods and the private methods of every ``torch.nn``
    module class, less tensor method names (``to`` is allowed, ``half`` is reported as a torch op)."""
    import inspect

    import torch.nn as nn

    out = {n for n in dir(nn.Module) if not n.startswith("__")}
    for v in vars(nn).values():
        if inspect.isclass(v) and issubclass(v, nn.Module):
            for k in inspect.getmro(v):
                out.update(n for n in vars(k) if n.startswith("_") and not n.startswith("__"))
    return frozenset(out - ALLOWED_TENSOR_METHODS - _tensor_compute_methods())


@functools.cache
def _torch_attribute_names() -> frozenset[str]:
    """Every attribute name of ``torch.Tensor``, ``nn.Parameter`` and the module classes of ``torch.nn`` (methods and
    properties, private ones too: ``sum``, ``forward``, ``reset_parameters``, ``flatten_parameters``...)."""
    import inspect

    import torch
    import torch.nn as nn

    out = set(dir(torch.Tensor)) | set(dir(nn.Parameter))
    for v in vars(nn).values():
        if inspect.isclass(v) and issubclass(v, nn.Module):
            out.update(dir(v))
    return frozenset(out)


@functools.cache
def _reserved_names() -> frozenset[str]:
    """Method names torch or the run time may call on a candidate's class without its code mentioning them
    (``forward``, every attribute of ``nn.Module``: ``extra_repr``, ``_apply``, ``_load_from_state_dict``...; the
    methods torch calls on a ``torch.autograd.Function``: ``backward``, ``setup_context``, ``jvp``, ``vjp``,
    ``vmap``; a candidate's classes derive only from those): never construction code
    (:func:`~dice_ray.verify.candidate.liveness.construction_code`)."""
    import torch.nn as nn

    return frozenset(dir(nn.Module)) | _CTX_METHODS | {"vmap"}


@functools.cache
def _function_attribute_names() -> frozenset[str]:
    """Every attribute of ``torch.autograd.Function`` and of the ctx torch hands its methods (``saved_tensors``,
    ``next_functions``, ``to_save``...): a field the candidate stores on a ctx may not shadow one."""
    import torch

    return frozenset(dir(torch.autograd.Function)) | frozenset(dir(torch.autograd.function.BackwardCFunction))


_UNKNOWN = object()


def _lookup(dotted: str) -> object:
    """The object an import-rooted path (``torch.nn.functional.gelu``, ``torch.Tensor.add``) names,
    read from the loaded modules' ``__dict__`` and classes' static attributes (nothing is imported
    lazily, no descriptor runs); :data:`_UNKNOWN` when it cannot be known."""
    import importlib
    import inspect
    import sys

    parts = dotted.split(".")
    obj: object = _UNKNOWN
    rest: list[str] = []
    for k in range(len(parts), 0, -1):
        name = ".".join(parts[:k])
        obj = sys.modules.get(name, _UNKNOWN)
        if obj is _UNKNOWN and name in ALLOWED_IMPORTS:
            obj = importlib.import_module(name)
        if obj is not _UNKNOWN:
            rest = parts[k:]
            break
    for part in rest:
        if isinstance(obj, types.ModuleType):
            obj = vars(obj).get(part, sys.modules.get(f"{obj.__name__}.{part}", _UNKNOWN))
        elif isinstance(obj, type):
            obj = inspect.getattr_static(obj, part, _UNKNOWN)
        else:
            return _UNKNOWN
        if obj is _UNKNOWN:
            return _UNKNOWN
    return obj


def _is_torch_function(obj: object) -> bool:
    """Whether ``obj`` (from :func:`_lookup`) is a function or method of torch (an op when called),
    not a class (``torch.Tensor``, ``nn.ReLU``), a dtype or a module."""
    if obj is _UNKNOWN or isinstance(obj, (type, types.ModuleType)):
        return False
    return callable(obj) or isinstance(obj, (staticmethod, classmethod))


def _format_fields(template: str) -> list[str]:
    """Every replacement field name of a ``str.format`` template, nested ones (in format specs)
    included; raises ValueError on a malformed template."""
    import string

    out: list[str] = []
    for _, name, spec, _ in string.Formatter().parse(template):
        if name is not None:
            out.append(name)
        if spec:
            out.extend(_format_fields(spec))
    return out


# -- ways out through attributes (corpus: tests/corpus/cheats/forge_verdict.py, frame_escape.py, ...) --
#: attributes that lead from a generator, coroutine, traceback or frame to frames and their globals
#: (``gen.gi_frame.f_back.f_globals`` reaches the verifier's harness), refused like dunders
_INTROSPECTION_ATTRS = frozenset({
    "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "ag_frame", "ag_code", "ag_await",
    "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "tb_frame", "tb_next",
})
#: private torch functions that honest weight initialisation calls, as ``nn.Linear.reset_parameters`` does
#: (``fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)``): plain functions of ``torch.nn.init``,
#: allowed where torch is (``__init__``); run-time code may call them no more than any torch op
_INIT_HELPERS = frozenset({"torch.nn.init._calculate_fan_in_and_fan_out", "torch.nn.init._calculate_correct_fan",
                           "torch.nn.init._no_grad_uniform_", "torch.nn.init._no_grad_normal_"})
#: torch path components that read or write files (``__init__`` may otherwise call torch freely)
_TORCH_FILE_IO = frozenset({"load", "save", "from_file", "serialization", "package", "onnx", "profiler"})
#: torch functions that return a module (``torch.get_device_module('cuda').Stream()``): its attributes
#: are out of reach of the rules on import-rooted paths (streams, the CUDA runtime's bindings)
_MODULE_RETURNING = frozenset({"torch.get_device_module", "torch.cuda.cudart"})
#: attribute names that read or write files on any object (``tensor.numpy().tofile(path)``)
_FILE_IO_ATTRS = frozenset({"tofile", "fromfile", "from_file", "dump"})
#: names that evaluate a string as Python code (``typing.get_type_hints`` evaluates string annotations,
#: ``ForwardRef('...')._evaluate``): the string holds code no rule reads, run with real builtins
_STRING_EVAL_NAMES = frozenset({"get_type_hints", "ForwardRef", "_eval_type", "_evaluate", "evaluate_forward_ref",
                                "_type_check", "_type_convert"})


def _module_escape(dotted: str) -> tuple[str, str] | None:
    """``(rule, module)`` when the attribute path ``dotted`` (rooted at an allowed import, e.g.
    ``torch.os.write`` or ``typing.sys.modules``) passes through a module the candidate may not
    import: one outside :data:`ALLOWED_IMPORTS` (``forbidden-import``: torch re-exports ``os``,
    ``sys``, ``ctypes``...) or a torch internal (``torch-internals``).  Walks the real modules'
    ``__dict__`` and classes' static attributes, so nothing is imported lazily; None when clean or
    unknown.
    """
    import sys

    parts = dotted.split(".")
    k = next((k for k in range(len(parts), 0, -1)
              if ".".join(parts[:k]) in sys.modules or ".".join(parts[:k]) in ALLOWED_IMPORTS), 0)
    for j in range(k + 1, len(parts) + 1):
        obj = _lookup(".".join(parts[:j]))
        if obj is _UNKNOWN:
            return None
        if isinstance(obj, types.ModuleType):
            name = getattr(obj, "__name__", "?")
            if name.startswith("torch.") and (
                any(p.startswith("_") for p in name.split(".")) or any(name == r or name.startswith(r + ".")
                                                                      for r in _INTERNAL_ROOTS)):
                return "torch-internals", name
            if name not in ALLOWED_IMPORTS and not name.startswith("torch."):
                return "forbidden-import", name
    return None


def _root(node: ast.AST) -> ast.AST:
    """The name an attribute, item or call path starts from (``self`` for ``self.w.view(-1)[0]``, and for
    ``getattr(self, "w")``: the object getattr reads)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and node.args):
            node = node.args[0]
            continue
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


class _Checker(ast.NodeVisitor):
    def __init__(self, tree: ast.Module, dead: DeadCode, inline: bool = False,
                 input_dtypes: frozenset[str] | None = None):
        self.tree = tree
        self.input_dtypes = input_dtypes  # the task's (tasks.sizing.input_dtypes); None: not known, float32 assumed
        self.inline = inline  # the load_inline format: load_inline(...) holds kernels like load_cuda(...)
        self.report = StaticReport(format="inline" if inline else "fast")
        self.aliases: dict[str, str] = {}
        self.kernel_vars: set[str] = set()
        self.kernel_attrs: set[str] = set()
        self.kernel_fn_attrs: set[str] = set()  # self.k = kernels.relu_kernel (or a table of kernels)
        self.module_names: set[str] = set()
        self.class_methods: dict[str, set[str]] = {}
        self.function_classes: set[str] = set()  # module-level torch.autograd.Function wrappers (X.apply(...))
        self.ctx_params: dict[int, str] = {}  # id() of a wrapper's forward/backward... -> its ctx parameter's name
        self.ctx_fields: set[str] = set()  # names the candidate stores on a ctx (ctx.alpha = alpha)
        self.own_methods: set[str] = set()  # every method name of the candidate's classes
        self.local_classes: set[str] = set()
        self.runtime_depth = 0
        self.init_depth = 0  # inside an __init__ method (torch may be used freely there)
        # name -> values bound to it anywhere (None: unknown; a tuple (function, its parameters): a parameter)
        self.bindings: dict[str, list[ast.AST | tuple[ast.AST, list[str]] | None]] = {}
        self.calls_by_name: dict[str, list[ast.Call]] = {}  # function name -> calls f(...) / x.f(...)
        self.value_refs: set[str] = set()  # names used other than as the function of a call
        self.top_values: dict[str, ast.AST] = {}  # module-level NAME = value (one assignment)
        self.direct_class: str | None = None  # set while visiting a class body (its defs are methods)
        self.scopes: list[set[str]] = [_bound_names(tree)]
        self.kernel_calls_in_runtime = 0
        self.dead = dead  # never runs: not judged (dice_ray.verify.candidate.liveness)
        # what runs only while ModelNew is built (__init__ and what only it calls): judged as __init__ is
        self.construction = construction_code(tree, dead, _reserved_names())
        self.functions: list[ast.AST] = []  # the functions (and lambdas) being visited, innermost last
        # __init__ of classes run-time code builds: run-time code, but its stores on self fill a new object
        self.fresh_inits: set[int] = set()

    # -- helpers ---------------------------------------------------------------------------------
    def add(self, rule: str, message: str, node: ast.AST | None) -> None:
        fn = self.functions[-1] if self.functions else None
        why = self.construction.why_runtime.get(id(fn)) if self.runtime_depth else None
        if why is not None and rule in ("forward-torch-op", "forward-state", "forward-module-call"):
            if id(fn) in self.fresh_inits:  # the __init__ of a class run-time code builds
                message += (f"; this __init__ runs at run time: {why} (build it in ModelNew.__init__ and keep it, or "
                            "do this work in a kernel)")
            else:  # a method __init__ calls that is run-time code all the same
                name = getattr(fn, "name", "?")
                message += (f"; {name}() is run-time code although __init__ calls it: it is also {why} (only what "
                            "__init__ alone calls is construction code: keep the run-time use out of it)")
        self.report.violations.append(Violation(rule, message, getattr(node, "lineno", None)))

    def dotted(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def is_load_cuda(self, node: ast.AST) -> bool:
        """A call that returns kernels: load_cuda, or torch's load_inline in the load_inline format."""
        loaders = ("dice_ray.launch.load_cuda", "torch.utils.cpp_extension.load_inline") if self.inline else (
            "dice_ray.launch.load_cuda",)
        return isinstance(node, ast.Call) and self.dotted(node.func) in loaders

    def kernel_holder(self, node: ast.AST) -> str | None:
        """'kernels' for Name kernels, 'self.k' for self.k holding a KernelModule."""
        if isinstance(node, ast.Name) and node.id in self.kernel_vars:
            return node.id
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr in self.kernel_attrs):
            return f"self.{node.attr}"
        return None

    def state_rooted(self, node: ast.AST) -> bool:
        """Whether ``node`` is rooted at ``self``, a module-level name or a name bound to ``self``'s (state kept
        across calls)."""
        root = _root(node)
        return isinstance(root, ast.Name) and (root.id == "self" or root.id in self.module_names
                                               or self.bound_to_self(root.id))

    def check_cast(self, node: ast.Call, f: ast.Attribute) -> None:
        """``x.to(...)``, ``x.type(...)`` and the casts of :data:`_CAST_METHODS` (``x.float()`` is
        ``x.to(torch.float32)``), judged alike in run-time code.  A cast that may change nothing is left to the run-time
        op check, which sees the aten ``_to_copy`` of one that converts (a cast whose input dtype is not its target)
        and refuses it: a cast to float32 or float64 (:data:`_WIDE_DTYPES`: it cannot lower precision), to one of the
        task's input dtypes (``input_dtypes``: ``.half()`` on a float16 task's input, ``.long()`` on int64 indices),
        to a device, or to a dtype the rules cannot read.  A cast to any other dtype the rules read (``.half()``,
        ``.long()``, ``.to(torch.bfloat16)`` on a float32 task) converts, an elementwise torch op outside the
        candidate's kernels and the shape of a precision downgrade: refused here (rule forward-torch-op; the kernel
        can read or write that type)."""
        if f.attr in _CAST_METHODS:
            dtype, spelled = _CAST_METHODS[f.attr], f".{f.attr}()"
        else:
            dtype, spelled = None, f".{f.attr}(...)"
            for arg in [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]:
                found = _dtype_name(self.dotted(arg) if not isinstance(arg, ast.Constant) else arg.value)
                dtype = found or dtype
        task = self.input_dtypes if self.input_dtypes is not None else frozenset({"float32"})
        if dtype is None or dtype in _WIDE_DTYPES or dtype in task:
            return
        known = (f"no input of the task is {dtype} (they are {', '.join(sorted(task))})"
                 if self.input_dtypes is not None else "the task's input dtypes are not known here (float32 assumed)")
        alias = f" ({spelled} is .to(torch.{dtype}))" if f.attr in _CAST_METHODS else ""
        self.add("forward-torch-op", f"casts to torch.{dtype} with {spelled} in run-time code{alias}: {known}, so it "
                 "converts: an elementwise torch op outside the kernels; let the kernel read or write "
                 f"{dtype} itself (casts to float32, float64 and the task's input dtypes are left "
                 "to the run-time check, which refuses one that converts)", node)

    def bound_to_self(self, name: str) -> bool:
        """Whether ``name`` is bound somewhere to a value rooted at ``self`` (``c = self.calls``, ``v = self.w.view(-1)``)."""
        return any(isinstance(v, ast.AST) and isinstance(_root(v), ast.Name) and _root(v).id == "self"
                   for v in self.bindings.get(name, ()))

    def own_object(self, node: ast.AST) -> bool:
        """Whether ``node`` is ``self``, ``cls`` or one of the candidate's classes by name (its private
        attributes are the candidate's own), or an import-rooted path (:meth:`check_escape` judges those)."""
        if isinstance(node, ast.Name) and (node.id in ("self", "cls") or node.id in self.local_classes):
            return True
        return self.dotted(node) is not None

    def is_module_alias(self, name: str) -> bool:
        """Whether the import alias ``name`` names a module (``torch``, ``nn``), not a function or class."""
        import sys
        import types

        target = self.aliases.get(name, "")
        return target in ALLOWED_IMPORTS or isinstance(sys.modules.get(target), types.ModuleType)

    def check_escape(self, node: ast.Attribute) -> None:
        """On the outermost attribute of an import-rooted path: modules reached through attributes
        (``torch.os``), torch file I/O (``torch.load``) and private torch attributes, anywhere
        (``__init__`` included)."""
        if isinstance(getattr(node, "parent", None), ast.Attribute):
            return
        d = self.dotted(node)
        if d is None:
            return
        hit = _module_escape(d)
        parts = d.split(".")
        if _GLOBAL_SETTERS.match(d):
            self.add("patching", f"uses {d} (changes global torch state or hooks shared with the reference)", node)
        elif d in _MODULE_RETURNING:
            self.add("dynamic-code", f"uses {d}, which returns a module (its attributes escape the rules)", node)
        elif hit is not None:
            self.add(hit[0], f"{d} reaches the module {hit[1]}", node)
        elif not _dice_ray_use_ok(d):
            self.add("patching", _dice_ray_use_message(d), node)
        elif parts[0] == "torch" and any(p in _TORCH_FILE_IO for p in parts[1:]):
            self.add("file-access", f"uses {d} (file I/O)", node)
        elif d in _INIT_HELPERS:
            pass
        elif parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
            self.add("torch-internals", f"uses {d} (a private torch attribute)", node)
        elif any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
            self.add("dynamic-code", f"uses {d} (a private attribute of {parts[0]}: typing._eval_type...)", node)

    # -- pre-pass: imports, module names, kernel holders, classes ----------------------------------
    def prepass(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in self.tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                self.module_names.update(names)
                if node.value is not None and self.is_load_cuda(node.value):
                    self.kernel_vars.update(names)
            elif isinstance(node, ast.ClassDef):
                self.local_classes.add(node.name)
                self.class_methods[node.name] = {
                    n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.module_names.add(node.name)
        top_count: dict[str, int] = {}
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                self.top_values.update(_unpacked(node.targets[0], node.value))  # N = 1; D, H, W = 16, 32, 32
            for t in (node.targets if isinstance(node, ast.Assign) else
                      [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []):
                for n in ast.walk(t):  # every name bound, unpacked ones too: a name bound twice has no one value
                    if isinstance(n, ast.Name):
                        top_count[n.id] = top_count.get(n.id, 0) + 1
        for name, n in top_count.items():
            if n > 1:
                self.top_values.pop(name, None)
        self.own_methods = set().union(*self.class_methods.values())
        self.collect_bindings()
        self.collect_function_classes()
        for node in ast.walk(self.tree):  # self.k = kernels / load_cuda(...) inside methods
            if isinstance(node, ast.Assign) and (
                self.is_load_cuda(node.value) or (isinstance(node.value, ast.Name) and node.value.id in self.kernel_vars)
            ):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        self.kernel_attrs.add(t.attr)
        self.collect_kernel_fn_attrs()

    def collect_function_classes(self) -> None:
        """The module-level classes that derive only from ``torch.autograd.Function`` (or from such classes of the
        candidate), are not ``ModelNew`` and whose name names nothing else: wrappers whose ``X.apply(...)`` run-time
        code may call (their methods are run-time code, judged as ``forward`` is); and the ctx parameter of each of
        their methods torch calls with one (:data:`_CTX_METHODS`), unless the method rebinds it, with the fields the
        candidate stores on it."""
        classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        changed = True
        while changed:
            changed = False
            for name, cls in classes.items():
                if name in self.function_classes or name == "ModelNew" or not cls.bases or cls.keywords:
                    continue
                if len(self.bindings.get(name, ())) != 1:
                    continue  # the name is bound to something else too
                if all(self.dotted(b) in _FUNCTION_BASES or (isinstance(b, ast.Name) and b.id in self.function_classes)
                       for b in cls.bases):
                    self.function_classes.add(name)
                    changed = True
        for name in self.function_classes:
            methods = [m for m in classes[name].body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            split = any(m.name == "setup_context" for m in methods)  # forward(*args) + setup_context(ctx, ...)
            for m in methods:
                params = [*m.args.posonlyargs, *m.args.args]
                if m.name not in _CTX_METHODS or not params or (m.name == "forward" and split):
                    continue
                ctx = params[0].arg
                rebound = any(isinstance(n, ast.Name) and n.id == ctx and isinstance(n.ctx, (ast.Store, ast.Del))
                              for n in ast.walk(m)) or any(
                    isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)) and n is not m
                    for n in ast.walk(m))
                if rebound:
                    continue  # judged as any other object: only self's attributes may be assigned
                self.ctx_params[id(m)] = ctx
                for n in ast.walk(m):
                    if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                            and n.value.id == ctx and not n.attr.startswith("_")
                            and n.attr not in _function_attribute_names()):
                        self.ctx_fields.add(n.attr)

    def current_ctx(self, node: ast.AST) -> bool:
        """Whether ``node`` is the ctx parameter of the Function wrapper's method being visited."""
        fn = self.functions[-1] if self.functions else None
        return isinstance(node, ast.Name) and fn is not None and self.ctx_params.get(id(fn)) == node.id

    def is_function_apply(self, node: ast.AST | None) -> bool:
        """``X.apply`` of a Function wrapper of the candidate (:meth:`collect_function_classes`)."""
        return (isinstance(node, ast.Attribute) and node.attr == "apply" and isinstance(node.value, ast.Name)
                and node.value.id in self.function_classes)

    def collect_kernel_fn_attrs(self) -> None:
        """``self.<a>`` attributes that hold a kernel or a table of kernels: every assignment to one is
        ``self.<a> = kernels.<name>`` (a choice of them, or a literal list/tuple/dict of them) and every
        other use calls it (``self.<a>(...)``) or indexes it (``self.<a>[...]``), so nothing else can be
        put in or taken out under that name."""
        values: dict[str, list[ast.AST | None]] = {}
        uses_ok: dict[str, bool] = {}
        for node in ast.walk(self.tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
                continue
            parent = getattr(node, "parent", None)
            if isinstance(node.ctx, ast.Store):
                simple = isinstance(parent, ast.Assign) and node in parent.targets
                values.setdefault(node.attr, []).append(parent.value if simple else None)
            elif isinstance(node.ctx, ast.Load):
                used = (isinstance(parent, ast.Call) and parent.func is node) or (
                    isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, ast.Load))
                uses_ok[node.attr] = uses_ok.get(node.attr, True) and used
            else:
                uses_ok[node.attr] = False
        for attr, vals in values.items():
            if uses_ok.get(attr, True) and all(v is not None and (self.is_kernel_ref(v) or self.is_kernel_table(v))
                                               for v in vals):
                self.kernel_fn_attrs.add(attr)

    def collect_bindings(self) -> None:
        """Every binding of every name (values of simple assignments, defs, lambdas, parameters; None
        where the value is not known), the calls of each function name, and the names used as values:
        what decides whether run-time code calling a name calls something the rules have seen."""
        def bind(name: str, value: ast.AST | tuple[ast.AST, list[str]] | None) -> None:
            self.bindings.setdefault(name, []).append(value)

        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        bind(t.id, node.value)
                    else:
                        for n in ast.walk(t):
                            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                                bind(n.id, None)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                if isinstance(node.target, ast.Name):
                    bind(node.target.id, node.value if isinstance(node, ast.AnnAssign) else None)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(node.name, node)
                if not isinstance(node, ast.ClassDef):
                    a = node.args
                    params = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
                    for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                        if x is not None:
                            bind(x.arg, (node, params))
            elif isinstance(node, ast.Lambda):
                a = node.args
                for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                    if x is not None:
                        bind(x.arg, None)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                parent = getattr(node, "parent", None)
                if isinstance(parent, (ast.For, ast.comprehension)) and parent.target is node and isinstance(
                        parent.iter, (ast.Tuple, ast.List)) and parent.iter.elts and not any(
                        isinstance(e, ast.Starred) for e in parent.iter.elts):
                    for e in parent.iter.elts:  # for k in (kernels.a, kernels.b)
                        bind(node.id, e)
                elif not isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                    bind(node.id, None)  # loop, with, comprehension, except targets, unpacking
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    bind((a.asname or a.name).split(".")[0], None)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bind(node.name, None)
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name is not None:
                    self.calls_by_name.setdefault(name, []).append(node)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                parent = getattr(node, "parent", None)
                if not (isinstance(parent, ast.Call) and parent.func is node):
                    self.value_refs.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                parent = getattr(node, "parent", None)
                if not (isinstance(parent, ast.Call) and parent.func is node):
                    self.value_refs.add(node.attr)

    def is_kernel_ref(self, node: ast.AST | None) -> bool:
        """``kernels.<name>`` / ``self.k.<name>``, a name or ``self`` attribute bound only to those, a
        choice of them, or an entry of a table of them (``table[x.dtype]``, :meth:`is_kernel_table`)."""
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.kernel_fn_attrs:
                return True
            return self.kernel_holder(node.value) is not None
        if isinstance(node, ast.IfExp):
            return self.is_kernel_ref(node.body) and self.is_kernel_ref(node.orelse)
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            return self.is_kernel_table(node.value)
        if isinstance(node, ast.Name):
            values = self.bindings.get(node.id, [])
            return bool(values) and node.id not in self.aliases and all(
                isinstance(v, (ast.Attribute, ast.IfExp, ast.Subscript)) and self.is_kernel_ref(v) for v in values)
        return False

    def is_kernel_table(self, node: ast.AST | None, depth: int = 0) -> bool:
        """A literal list, tuple or dict whose entries are all kernels (:meth:`is_kernel_ref`), a name
        bound only to such literals and only ever indexed (never stored into, mutated or passed on),
        or a ``self`` attribute of :meth:`collect_kernel_fn_attrs` holding one."""
        if depth > 8:
            return False
        if isinstance(node, (ast.List, ast.Tuple)):
            return bool(node.elts) and all(self.is_kernel_ref(e) for e in node.elts)
        if isinstance(node, ast.Dict):
            return bool(node.values) and None not in node.keys and all(self.is_kernel_ref(v) for v in node.values)
        if isinstance(node, ast.Attribute):
            return isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.kernel_fn_attrs
        if isinstance(node, ast.Name) and node.id not in self.aliases:
            values = self.bindings.get(node.id, [])
            return bool(values) and all(isinstance(v, (ast.List, ast.Tuple, ast.Dict)) and self.is_kernel_table(v, depth + 1)
                                        for v in values) and self.only_indexed(node.id)
        return False

    def only_indexed(self, name: str) -> bool:
        """Whether every load of the name ``name`` indexes it for reading (``name[i]``)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Store):
                parent = getattr(node, "parent", None)
                if not (isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, ast.Load)):
                    return False
        return True

    def param_gets_kernels(self, name: str, fn: ast.AST, params: list[str]) -> bool:
        """Whether the parameter ``name`` of ``fn`` receives a kernel at every call of ``fn`` (which
        is called at least once and never used as a value: ``map(fn, ...)`` would hide its arguments)."""
        fname = getattr(fn, "name", None)
        calls = self.calls_by_name.get(fname or "", [])
        if fname is None or not calls or fname in self.value_refs or name not in params:
            return False
        index = params.index(name)
        for call in calls:
            bound = isinstance(call.func, ast.Attribute) and params[:1] == ["self"]
            i = index - 1 if bound else index
            arg = next((k.value for k in call.keywords if k.arg == name), None)
            if arg is None and 0 <= i < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[:i + 1]):
                arg = call.args[i]
            if arg is None or not self.is_kernel_ref(arg):
                return False
        return True

    def is_method_ref(self, node: ast.Attribute) -> bool:
        """``self.<m>`` / ``<Class>.<m>`` naming a method the candidate defines (not a Function wrapper's method
        torch calls with a ctx: ``map(X.backward, ...)`` would hand it any object as ctx)."""
        return isinstance(node.value, ast.Name) and (node.value.id == "self" or node.value.id in self.local_classes) \
            and node.attr in self.own_methods and not (node.value.id in self.function_classes
                                                       and node.attr in _CTX_METHODS)

    def callee_known(self, f: ast.AST) -> bool:
        """Whether run-time code calling (or handing to ``map``) the expression ``f`` calls something
        the rules see: a builtin, an import (checked by name), a def/class/lambda of the candidate or
        a kernel.  A variable, parameter, subscript or call result may hold a torch op or a
        submodule (``f = self.f; f(x)``, ``self._modules['act'](x)``)."""
        if isinstance(f, ast.Lambda) or self.is_kernel_ref(f):
            return True
        if isinstance(f, ast.Attribute):
            return True  # attribute calls are checked by name (check_runtime_call)
        if not isinstance(f, ast.Name):
            return False
        if f.id in self.aliases:
            return True
        values = self.bindings.get(f.id)
        if not values:
            import builtins

            return hasattr(builtins, f.id)
        for v in values:
            if isinstance(v, tuple):
                if not self.param_gets_kernels(f.id, *v):
                    return False
            elif isinstance(v, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            elif v is None or not (self.is_kernel_ref(v) or self.is_function_apply(v)):
                return False
        return True

    # -- top level -------------------------------------------------------------------------------
    def check_module(self) -> None:
        self.prepass()
        model_new = next((n for n in self.tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelNew"), None)
        if model_new is None or "forward" not in self.class_methods.get("ModelNew", set()):
            self.add("no-modelnew", "no top-level class ModelNew with a forward() method", model_new)
        for node in self.tree.body:
            self.check_top_statement(node)
        self.visit(self.tree)
        if model_new is not None and self.kernel_calls_in_runtime == 0:
            self.add("no-kernel-launch", "no run-time code uses a kernel of a load_cuda module (kernels.<name>)",
                     model_new)

    def constantish(self, node: ast.AST | None) -> bool:
        if node is None or isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Name):
            return True  # a reference to another top-level constant or import
        if isinstance(node, ast.Attribute):
            return self.dotted(node) is not None  # torch.float32, math.pi
        if isinstance(node, (ast.Tuple,)):
            return all(self.constantish(e) for e in node.elts)
        if isinstance(node, ast.BinOp):
            return self.constantish(node.left) and self.constantish(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.constantish(node.operand)
        if isinstance(node, ast.JoinedStr):
            return all(self.constantish(v.value if isinstance(v, ast.FormattedValue) else v) for v in node.values)
        if isinstance(node, ast.Call):  # "...".format(...) / SRC.replace(...)
            f = node.func
            return (isinstance(f, ast.Attribute) and f.attr in _STR_METHODS
                    and isinstance(f.value, (ast.Constant, ast.Name, ast.JoinedStr))
                    and all(self.constantish(a) for a in node.args)
                    and all(self.constantish(k.value) for k in node.keywords))
        return False

    def loader_argument_list(self, value: ast.AST | None, names: list[str]) -> bool:
        """A list of constants (``cpp_sources = ["...", "..."]``, ``functions = ["f", "g"]``) whose names are read
        only as arguments of the module's ``load_inline`` / ``load_cuda`` calls: a build input, not a cache (no
        other code can reach it to mutate it)."""
        if not isinstance(value, ast.List) or not all(self.constantish(e) for e in value.elts):
            return False
        calls = [n for n in ast.walk(self.tree) if self.is_load_cuda(n)]
        inside = {id(n) for c in calls for n in ast.walk(c)}
        return all(id(n) in inside for n in ast.walk(self.tree)
                   if isinstance(n, ast.Name) and n.id in names and isinstance(n.ctx, ast.Load))

    def check_top_statement(self, node: ast.stmt) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Pass)):
            return
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # docstring
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) for t in targets) and (
                self.is_load_cuda(node.value) or self.constantish(node.value) or self.is_function_apply(node.value)
                or self.loader_argument_list(node.value, [t.id for t in targets])  # type: ignore[attr-defined]
            ):
                return
            # D, H, W = 16, 32, 32 (KernelBench references' style): a literal tuple of constants unpacked into names
            if node.value is not None and all(_unpacked(t, node.value) and all(
                    self.constantish(v) for v in _unpacked(t, node.value).values()) for t in targets):
                return
            self.add("module-state", "top-level assignment of a non-constant (state shared across calls): module top "
                     "level may bind names only to constants (N = 1024; D, H, W = 16, 32, 32), load_inline/load_cuda "
                     "results, imports, defs and classes; keep other values in ModelNew (set in __init__)", node)
            return
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            return
        self.add("module-state", f"top-level {type(node).__name__} statement (only imports, defs, classes, "
                 "constants and load_cuda(...) are allowed)", node)

    # -- visitors --------------------------------------------------------------------------------
    def visit_If(self, node: ast.If) -> None:
        if not self.dead.skips(node):  # an `if __name__ == "__main__":` block never runs (liveness)
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if id(a) not in self.dead.aliases:  # a name only dead code uses: never imported (liveness)
                self.check_import(a.name, (), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        names = tuple(a.name for a in node.names if id(a) not in self.dead.aliases)
        if not names:
            return  # only dead code uses it: never imported (liveness)
        if node.level:
            self.add("forbidden-import", "relative import", node)
            return
        if "*" in names:
            self.add("forbidden-import", f"star import from {node.module}", node)
            return
        self.check_import(node.module or "", names, node)

    def check_import(self, module: str, names: tuple[str, ...], node: ast.AST) -> None:
        if self.inline and import_allowed(module, names, inline=True):
            return
        if module.startswith("torch.utils.cpp_extension") or (module == "torch.utils" and "cpp_extension" in names):
            self.add("unsupported-format", f"imports {module} (load_inline): use dice_ray.launch.load_cuda", node)
        elif not import_allowed(module, names):
            what = f"from {module} import {', '.join(names)}" if names else f"import {module}"
            self.add("forbidden-import", f"{what} (allowed: {sorted(ALLOWED_IMPORTS)})", node)

    def visit_Try(self, node: ast.AST) -> None:
        self.add("try-except", "try statement (a fallback path around the kernel)", node)
        self.generic_visit(node)

    visit_TryStar = visit_Try

    def visit_Global(self, node: ast.AST) -> None:
        self.add("forward-state", f"{type(node).__name__.lower()} statement", node)

    visit_Nonlocal = visit_Global

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.name == "Model" and id(node) not in self.dead.classes:
            self.add("reference-model", "defines a class named Model (the reference's name)", node)
        for base in node.bases:
            d = self.dotted(base)
            if isinstance(base, ast.Name) and base.id == "Model":
                continue  # reported by visit_Name
            if d == "torch.nn.Module" or d == "torch.nn.modules.module.Module":
                if any(self.dotted(b) in _FUNCTION_BASES or (isinstance(b, ast.Name) and b.id in self.function_classes)
                       for b in node.bases):
                    self.add("base-class", f"class {node.name} derives from nn.Module and torch.autograd.Function",
                             node)
                continue
            if isinstance(base, ast.Name) and base.id in self.local_classes and (
                    base.id not in self.function_classes or node.name in self.function_classes):
                continue
            if node.name in self.function_classes and d in _FUNCTION_BASES:
                continue  # a torch.autograd.Function wrapper: its methods are run-time code, X.apply(...) calls them
            wrapper = d in _FUNCTION_BASES or (isinstance(base, ast.Name) and base.id in self.function_classes)
            why = ("a torch.autograd.Function wrapper must be a module-level class other than ModelNew, its name bound "
                   "once, deriving only from Function or such wrappers" if wrapper
                   else "only nn.Module, torch.autograd.Function and the candidate's own classes allowed")
            self.add("base-class", f"class {node.name} derives from {ast.unparse(base)} ({why})", node)
        for kw in node.keywords:
            self.add("base-class", f"class {node.name} uses the class keyword {kw.arg}=", node)
        for stmt in node.body:  # class-level mutable attributes are shared caches
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and not self.constantish(stmt.value):
                self.add("forward-state", f"class attribute of {node.name} is not a constant", stmt)
        saved, self.direct_class = self.direct_class, node.name
        self.generic_visit(node)
        self.direct_class = saved

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        if id(node) in self.dead.bodies:  # never called: only what the def statement runs is judged
            self.visit_dead_def(node)  # type: ignore[arg-type]
            return
        for d in [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]:
            if any(isinstance(n, (ast.List, ast.Dict, ast.Set, ast.Call, ast.ListComp, ast.DictComp, ast.SetComp))
                   for n in ast.walk(d)):  # ([],) too
                self.add("forward-state", "mutable default argument (a cache across calls)", d)
        direct_class, self.direct_class = self.direct_class, None
        if not isinstance(node, ast.Lambda):
            self.check_decorators(node)
        # construction code (__init__ of a class no run-time code builds, and what only such code calls:
        # liveness.construction_code) is judged as __init__; everything else, lambdas included, as run-time code
        is_init = not isinstance(node, ast.Lambda) and id(node) in self.construction.functions
        if not is_init and not isinstance(node, ast.Lambda) and node.name == "__init__" and direct_class is not None:
            self.fresh_inits.add(id(node))
        runtime = 0 if is_init else 1
        self.runtime_depth += runtime
        self.init_depth += 1 - runtime
        self.scopes.append(_bound_names(node))
        self.functions.append(node)
        self.generic_visit(node)
        self.functions.pop()
        self.scopes.pop()
        self.init_depth -= 1 - runtime
        self.runtime_depth -= runtime
        self.direct_class = direct_class

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def check_decorators(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            name = target.id if isinstance(target, ast.Name) and target.id not in self.aliases else self.dotted(target)
            if name not in _ALLOWED_DECORATORS:
                self.add("dynamic-code", f"decorator {ast.unparse(dec)} on {node.name}", dec)

    def visit_dead_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        """A function no live code can call (:func:`~dice_ray.verify.candidate.liveness.dead_code`: a copy of
        ``get_inputs``, a test helper): its decorators, defaults and annotations run where the ``def`` is
        (checked there), its body never."""
        self.check_decorators(node)
        for dec in node.decorator_list:
            self.visit(dec)
        self.visit(node.args)
        if node.returns is not None:
            self.visit(node.returns)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == "Model":
            self.add("reference-model", "uses the name Model (the reference class)", node)
        elif node.id == "getattr" and not any(node.id in scope for scope in self.scopes) and self.reads_attribute(node):
            pass  # getattr(self.lstm, "weight_ih_l" + suffix): a parameter read by name
        elif node.id in _FORBIDDEN_BUILTINS and not any(node.id in scope for scope in self.scopes):
            hint = (" (only getattr(self or self.<submodule>, name) reading a parameter, buffer or submodule may be used: "
                    "the name a constant string, or a '+' / f-string beginning with one that no method or torch "
                    "attribute name begins with, the value not called; else write self.<name>)"
                    if node.id == "getattr" else "")
            self.add(_FORBIDDEN_BUILTINS[node.id], f"uses {node.id}{hint}", node)
        elif node.id.startswith("__") and node.id not in _ALLOWED_DUNDERS:
            self.add("dynamic-code", f"uses the dunder name {node.id}", node)
        elif (node.id in self.aliases and isinstance(node.ctx, ast.Load) and not _dice_ray_use_ok(self.aliases[node.id])
              and not isinstance(getattr(node, "parent", None), ast.Attribute)):  # attributes: check_escape
            self.add("patching", _dice_ray_use_message(self.aliases[node.id]), node)
        elif self.current_ctx(node) and isinstance(node.ctx, ast.Load) and not (
                isinstance(getattr(node, "parent", None), ast.Attribute) and node.parent.value is node):
            self.add("dynamic-code", f"uses {node.id}, a Function wrapper's ctx, as a value (only ctx.<attr> is "
                     "followed by the rules)", node)
        elif node.id == "self" and self.runtime_depth and isinstance(node.ctx, ast.Load) and not self.self_ok(node):
            self.add("forward-state", "run-time code uses self as a value (under another name its attributes are "
                     "state across calls and escape the rules on self)", node)
        elif node.id in self.aliases and _GLOBAL_SETTERS.match(self.aliases[node.id]) and isinstance(node.ctx, ast.Load):
            self.add("patching", f"uses {self.aliases[node.id]} (changes global torch state or hooks shared with the "
                     "reference)", node)
        elif node.id in self.aliases and self.aliases[node.id] in _MODULE_RETURNING:
            self.add("dynamic-code", f"uses {self.aliases[node.id]}, which returns a module", node)
        elif node.id in self.aliases and self.aliases[node.id].split(".")[-1] in _STRING_EVAL_NAMES:
            self.add("dynamic-code", f"uses {self.aliases[node.id]} (evaluates a string as code: string annotations)",
                     node)
        elif node.id in self.aliases and self.is_module_alias(node.id) and not (
                isinstance(getattr(node, "parent", None), ast.Attribute) and node.parent.value is node):
            self.add("dynamic-code", f"uses the module {node.id} as a value (its attributes escape the rules)", node)
        elif node.id in self.aliases and isinstance(node.ctx, ast.Load) and not isinstance(
                getattr(node, "parent", None), (ast.Attribute, ast.alias)):
            self.check_torch_value(self.aliases[node.id], node)

    def reads_attribute(self, node: ast.Name) -> bool:
        """``getattr(obj, name)`` called where ``obj`` is ``self`` or a public attribute path of it (``self.lstm``)
        and ``name`` a constant string, or a ``+`` / f-string whose constant beginning (``"weight_ih_l" + suffix``)
        no name of a method (the candidate's, nn.Module's, torch.Tensor's), frame, file or kernel attribute begins
        with, and whose value is not called: a parameter, buffer or submodule read by name, as ``self.lstm.<name>``
        would be (every other rule judges the value as it judges that attribute; the worker's getattr refuses a
        private name and a function or method value: :func:`dice_ray.verify.trials.import_guard.read_attribute`)."""
        call = getattr(node, "parent", None)
        if not (isinstance(call, ast.Call) and call.func is node and len(call.args) == 2 and not call.keywords):
            return False
        obj, name = call.args
        while isinstance(obj, ast.Attribute) and not obj.attr.startswith("_"):
            obj = obj.value
        if not (isinstance(obj, ast.Name) and obj.id == "self"):
            return False
        user = getattr(call, "parent", None)
        if isinstance(user, ast.Call) and user.func is call:
            return False  # getattr(self, "forward")(x)
        text, exact = self.static_str(name), True
        if text is None:
            text, exact = self.static_prefix(name), False
        if not text or not (text if exact else text + "x").isidentifier() or text.startswith("_"):
            return False
        forbidden = (self.own_methods | _reserved_names() | _torch_attribute_names() | _INTROSPECTION_ATTRS
                     | _FILE_IO_ATTRS | _STRING_EVAL_NAMES | self.kernel_attrs | self.kernel_fn_attrs
                     | {"pin_memory", "format", "format_map"})
        return text not in forbidden if exact else not any(n.startswith(text) for n in forbidden)

    def static_prefix(self, node: ast.AST) -> str | None:
        """The constant beginning of a ``+`` of strings or an f-string (``"weight_ih_l" + suffix``,
        ``f"conv{i}"``), or None."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            whole = self.static_str(node.left)
            return whole if whole is not None else self.static_prefix(node.left)
        if isinstance(node, ast.JoinedStr):
            out = ""
            for v in node.values:
                text = self.static_str(v) if not isinstance(v, ast.FormattedValue) else None
                if text is None:
                    break
                out += text
            return out or None
        return None

    def self_ok(self, node: ast.Name) -> bool:
        """``self.<attr>``, ``super(Class, self)`` or ``getattr(self, name)`` read as :meth:`reads_attribute`
        allows: the uses of ``self`` the rules follow."""
        parent = getattr(node, "parent", None)
        return (isinstance(parent, ast.Attribute) and parent.value is node) or (
            isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "super") or (
            isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "getattr"
            and parent.args[:1] == [node] and self.reads_attribute(parent.func))

    def is_called(self, node: ast.AST) -> bool:
        parent = getattr(node, "parent", None)
        return isinstance(parent, ast.Call) and parent.func is node

    def check_torch_value(self, d: str, node: ast.AST) -> None:
        """A torch function taken as a value outside ``__init__`` (``R = torch.relu`` at top level or
        in a class body, ``f = F.gelu``, ``map(torch.relu, xs)``, ``nn.ReLU.forward``): it is called
        later under another name, where the call rules cannot see whose it is."""
        if self.is_called(node) or (self.init_depth and not self.runtime_depth) or d in ALLOWED_TORCH_CALLS:
            return
        up = getattr(node, "parent", None)
        if d in _ALLOWED_DECORATORS and isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node in up.decorator_list:
            return  # @once_differentiable: an allowed decorator (check_decorators), not an op under another name
        if (d == "torch" or d.startswith("torch.")) and _is_torch_function(_lookup(d)):
            self.add("forward-torch-op", f"takes {d} as a value outside __init__ (a torch op called under "
                     "another name)", node)

    def check_format(self, node: ast.Attribute) -> None:
        """``template.format(obj)`` walks attributes and items named in the template
        (``'{0.__globals__[os]}'``) where no rule sees them: the template must be a string the rules
        can read, and its fields may not name private, dunder or frame attributes."""
        template = self.static_str(node.value)
        if template is None:
            self.add("dynamic-code", f"calls .{node.attr}() on a template that is not a constant string "
                     "(format fields can walk attributes)", node)
            return
        try:
            fields = _format_fields(template)
        except ValueError:
            return  # fails when run
        for field_name in fields:
            for part in re.split(r"[.\[\]]", field_name)[1:]:
                if part.startswith("_") or part in _INTROSPECTION_ATTRS:
                    self.add("dynamic-code", f"the format field {{{field_name}}} walks to .{part} (reflection)", node)
                    return

    def static_str(self, node: ast.AST | None, depth: int = 0) -> str | None:
        """The value of a string expression built only from constants and module-level constant
        names (concatenation, f-strings, str methods), or None."""
        if node is None or depth > 20:
            return None
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.Name):
            return self.static_str(self.top_values.get(node.id), depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            a, b = self.static_str(node.left, depth + 1), self.static_str(node.right, depth + 1)
            return None if a is None or b is None else a + b
        if isinstance(node, ast.JoinedStr):
            out = []
            for v in node.values:
                if isinstance(v, ast.FormattedValue):
                    inner = v.value
                    if isinstance(inner, ast.Constant) or (isinstance(inner, ast.Name)
                                                           and isinstance(self.top_values.get(inner.id), ast.Constant)):
                        val = inner.value if isinstance(inner, ast.Constant) else self.top_values[inner.id].value
                        out.append(str(val))  # numbers too (f"{N}")
                        continue
                    text = self.static_str(inner, depth + 1)
                    if text is None:
                        return None
                    out.append(text)
                else:
                    text = self.static_str(v, depth + 1)
                    if text is None:
                        return None
                    out.append(text)
            return "".join(out)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _STR_METHODS \
                and node.func.attr != "format" and not node.keywords:
            base = self.static_str(node.func.value, depth + 1)
            args = [a.value if isinstance(a, ast.Constant) else self.static_str(a, depth + 1) for a in node.args]
            if base is None or any(a is None for a in args):
                return None
            try:
                return getattr(base, node.func.attr)(*args)
            except (TypeError, ValueError):
                return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
            return self.static_str(node.func.value, depth + 1)  # its own fields are checked where it is called
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr.startswith("__") and node.attr not in _ALLOWED_DUNDERS:
            self.add("dynamic-code", f"accesses the dunder attribute .{node.attr}", node)
        elif node.attr in _INTROSPECTION_ATTRS:
            self.add("dynamic-code", f"accesses .{node.attr} (frames and globals)", node)
        elif node.attr in _FILE_IO_ATTRS:
            self.add("file-access", f"uses .{node.attr} (file I/O)", node)
        elif node.attr == "pin_memory":
            self.add("host-memory", "uses .pin_memory (pinned host memory: a kernel given its address writes it)", node)
        elif node.attr in ("format", "format_map") and isinstance(node.ctx, ast.Load):
            self.check_format(node)
        elif node.attr in _STRING_EVAL_NAMES:
            self.add("dynamic-code", f"uses .{node.attr} (evaluates a string as code: string annotations, ForwardRef)",
                     node)
        elif node.attr.startswith("_") and not node.attr.startswith("__") and (
                not self.own_object(node.value) or (isinstance(node.value, ast.Name) and node.value.id in
                                                    self.function_classes and node.attr not in self.own_methods)):
            # a private attribute of an object the candidate did not make: a kernel's ctypes argument buffer
            # (``kernels.k._ptrs``: raw memory, then the verifier's globals), a tensor's internals, torch's
            # machinery of a Function wrapper (``X._backward_cls``)
            self.add("dynamic-code", f"accesses the private attribute .{node.attr} of an object the candidate did "
                     "not define (only self's, cls's and its own classes' may be used)", node)
        elif self.current_ctx(node.value) and node.attr not in _CTX_API and node.attr not in self.ctx_fields:
            self.add("dynamic-code", f"uses ctx.{node.attr}: a Function wrapper's ctx may be used only to save what "
                     f"backward needs ({', '.join(sorted(_CTX_API))}) and for the fields the candidate stores on it "
                     "(ctx.<name> = value); its other attributes are the autograd graph's", node)
        self.check_escape(node)
        self.check_value(node)
        holder = self.kernel_holder(node.value)
        if holder is not None:
            self.report.kernel_refs.setdefault(holder, set()).add(node.attr)
            if self.runtime_depth:
                self.kernel_calls_in_runtime += 1
        d = self.dotted(node)
        if d is not None and d.startswith("torch.") and not isinstance(getattr(node, "parent", None), ast.Attribute):
            parts = d.split(".")
            if any(p in _STREAM_NAMES for p in parts[1:]) and parts[1] in ("cuda", *_STREAM_NAMES):
                self.add("cuda-stream", f"uses {d}", node)
            elif self.inline and d == "torch.utils.cpp_extension.load_inline":
                pass
            elif d.startswith("torch._") or any(d == r or d.startswith(r + ".") for r in _INTERNAL_ROOTS):
                self.add("torch-internals", f"uses {d}", node)
        self.generic_visit(node)

    def check_value(self, node: ast.Attribute) -> None:
        """An attribute used as a value (not a call's function, not the base of a longer path):
        a module (``F = torch.nn.functional``, then ``F.torch.os``), a torch function outside
        ``__init__`` (``R = torch.relu``) or, in run-time code, a tensor's compute method
        (``f = y.relu``) is a way around the rules on names."""
        parent = getattr(node, "parent", None)
        if isinstance(parent, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            return
        d = self.dotted(node)
        if d is not None:
            obj = _lookup(d)
            if isinstance(obj, types.ModuleType):
                self.add("dynamic-code", f"uses the module {d} as a value (its attributes escape the rules)", node)
            else:
                self.check_torch_value(d, node)
        elif (self.runtime_depth and not self.is_called(node) and node.attr in _tensor_method_names()
              and self.kernel_holder(node.value) is None
              and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
            self.add("forward-torch-op", f"takes the tensor method .{node.attr} as a value in run-time code", node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if self.runtime_depth and isinstance(node.op, ast.MatMult):
            self.add("forward-torch-op", "matrix product operator @ in run-time code", node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if self.runtime_depth and isinstance(node.op, ast.MatMult):
            self.add("forward-torch-op", "matrix product operator @= in run-time code", node)
        self.check_targets([node.target], node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.check_targets(node.targets, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.check_targets([node.target], node)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self.check_targets(node.targets, node)
        self.generic_visit(node)

    def check_targets(self, targets: list[ast.expr], node: ast.AST) -> None:
        """Stores and deletes of attributes and items: ``patching`` for modules, kernel modules and
        attributes of anything but ``self`` (``m = nn.Module; m._call_impl = f``, ``type(self.act).forward
        = f``, ``s = self; s.cache = y``: a torch class, the reference's code or state under another
        name) and for ``self.<method> = ...`` (``self.forward = torch.relu`` replaces the forward the
        rules read); ``forward-state`` for run-time stores on ``self``, module names and classes."""
        flat: list[ast.expr] = []
        for t in targets:
            flat.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        for t in flat:
            if isinstance(t, ast.Starred):
                t = t.value
            if not isinstance(t, (ast.Attribute, ast.Subscript)):
                continue
            root = _root(t)
            name = root.id if isinstance(root, ast.Name) else None
            has_attr = any(isinstance(n, ast.Attribute) for n in _target_chain(t))
            if name is not None and (name in self.aliases or self.kernel_holder(root) or name in ("time", "builtins")):
                self.add("patching", f"assigns to {ast.unparse(t)} (a module or kernel module)", node)
            elif self.runtime_depth and name == "self" and self.functions and id(self.functions[-1]) in self.fresh_inits \
                    and isinstance(t, ast.Attribute) and t.value is root:
                pass  # self.x = x in the __init__ of an object run-time code builds: a field of a new object
            elif (isinstance(t, ast.Attribute) and self.current_ctx(t.value) and t.attr in self.ctx_fields):
                pass  # ctx.alpha = alpha in a Function wrapper: a field of the call's own ctx (torch makes one a call)
            elif self.runtime_depth and name is not None and (
                    name == "self" or name in self.module_names or name in self.local_classes):
                self.add("forward-state", f"run-time code assigns {ast.unparse(t)} (state across calls)", node)
            elif has_attr and name != "self":
                self.add("patching", f"assigns to {ast.unparse(t)}: only attributes of self may be assigned (a torch "
                         "class, the reference's code or shared state under another name)", node)
            elif (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                  and (t.attr in self.own_methods or t.attr in _module_method_names())):
                self.add("patching", f"assigns self.{t.attr}, a method (the instance's {t.attr} would not be the "
                         "code the rules read)", node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        d = self.dotted(f)
        if isinstance(f, ast.Name) and f.id == "type" and len(node.args) == 3:
            self.add("dynamic-code", "type() with 3 arguments creates a class dynamically", node)
        for k in node.keywords:
            if k.arg == "pin_memory" and not (isinstance(k.value, ast.Constant) and k.value.value in (False, None)):
                self.add("host-memory", "pin_memory= (pinned host memory: a kernel given its address writes it)", node)
        if d in ("torch.utils.cpp_extension.load_inline", "torch.utils.cpp_extension.load") and not (
                self.inline and d.endswith("load_inline")):
            self.add("unsupported-format", f"calls {d}", node)
        if self.runtime_depth:
            self.check_runtime_call(node, d)
        self.generic_visit(node)

    def check_runtime_call(self, node: ast.Call, d: str | None) -> None:
        f = node.func
        fname = f.id if isinstance(f, ast.Name) and f.id not in self.bindings else None
        handed = [k.value for k in node.keywords if k.arg == "key"]
        if (fname in ("map", "filter") and node.args) or (fname == "iter" and len(node.args) == 2):
            handed.append(node.args[0])  # builtins that call their first argument
        if d in CALLABLE_ARGUMENTS:  # itertools.starmap(f, ...), itertools.accumulate(xs, f)...
            positions, keywords = CALLABLE_ARGUMENTS[d]
            handed += [node.args[i] for i in positions if i < len(node.args)]
            handed += [k.value for k in node.keywords if k.arg in keywords and k.arg != "key"]
        if fname == "next" and node.args and self.state_rooted(node.args[0]):
            self.add("forward-state", f"run-time code advances {ast.unparse(node.args[0])}, an iterator kept across calls "
                     "(a call counter: itertools.count(), iter(range(...)) on self); iterate what the call is given "
                     "instead", node)
        for h in handed:
            if not self.callee_known(h) or (isinstance(h, ast.Attribute) and not self.is_kernel_ref(h)
                                            and self.dotted(h) is None and not self.is_method_ref(h)):
                self.add("forward-module-call", f"hands {ast.unparse(h)} to {ast.unparse(f)} to call (a torch op or "
                         "submodule called where the rules cannot see it)", node)
        if not self.callee_known(f):
            self.add("forward-module-call", f"calls {ast.unparse(f)}, a value that may hold a torch op or a submodule "
                     "(only builtins, the candidate's functions and classes, imports and kernels may be called)", node)
            return
        if d is not None:
            if d == "torch.Tensor" and _tensor_allocation(node):
                return  # torch.Tensor() / torch.Tensor(0) / torch.Tensor(n, m): an empty or uninitialised tensor
            if (d == "torch" or d.startswith("torch.")) and d not in ALLOWED_TORCH_CALLS and not _GLOBAL_SETTERS.match(d):
                hint = (" (torch.Tensor(data) copies values: torch.tensor(data) or torch.empty(sizes) allocate)"
                        if d == "torch.Tensor" else "")
                self.add("forward-torch-op", f"calls {d} in run-time code{hint} (only allocation and metadata calls may run "
                         "there, torch.empty, torch.zeros_like, torch.cuda.current_device...: rules.ALLOWED_TORCH_CALLS; "
                         "compute belongs in a kernel, weight set-up in __init__)", node)
            return
        if self.is_kernel_ref(f):
            self.kernel_calls_in_runtime += 1  # a kernel launch (self.k(...), table[i](...), k(...))
            return
        if not isinstance(f, ast.Attribute):
            return
        if f.attr in ("forward", "__call__"):
            self.add("forward-module-call", f"calls .{f.attr}() in run-time code", node)
            return
        if self.is_function_apply(f):
            return  # X.apply(...) of a Function wrapper: runs X.forward, whose body the rules judge as run-time code
        if isinstance(f.value, ast.Name) and f.value.id in self.function_classes and f.attr in _CTX_METHODS:
            self.add("forward-module-call", f"calls {ast.unparse(f)} directly: torch calls a Function wrapper's "
                     f"{f.attr} with a ctx of its own (any object handed as ctx would get its fields: state across "
                     f"calls); call {f.value.id}.apply(...)", node)
            return
        if isinstance(f.value, ast.Name) and f.value.id in self.local_classes and f.attr not in \
                self.class_methods.get(f.value.id, set()):
            self.add("forward-module-call", f"calls {ast.unparse(f)}, a class attribute (a torch op or submodule)", node)
            return
        if (f.attr in ("to", "type") or (f.attr in _CAST_METHODS and not (isinstance(f.value, ast.Name)
                                                                         and f.value.id == "self"))) \
                and f.attr not in self.own_methods:
            self.check_cast(node, f)
            return
        if f.attr not in self.own_methods and (f.attr in _module_method_names() or f.attr.startswith("_")):
            self.add("forward-module-call", f"calls .{f.attr}() in run-time code (a torch.nn.Module method or a "
                     "private torch method)", node)
            return
        if isinstance(f.value, ast.Name) and f.value.id == "self":
            if f.attr not in self.own_methods and f.attr not in ALLOWED_TENSOR_METHODS:
                self.add("forward-module-call", f"calls self.{f.attr}(...) (a submodule or torch method) in run-time code",
                         node)
            return
        root = _root(f.value)
        in_place = f.attr in _MUTATORS or (f.attr.endswith("_") and not f.attr.startswith("_"))  # fill_, zero_
        if in_place and isinstance(root, ast.Name) and (root.id == "self" or root.id in self.module_names
                                                        or self.bound_to_self(root.id)):
            # a tensor of self's (or a name bound to one: c = self.calls) changed in place is state across calls: a
            # call counter that switches the computation once the correctness trials are over
            self.add("forward-state", f"run-time code mutates {ast.unparse(f)}", node)
            return
        if f.attr in _tensor_compute_methods() and not (f.attr == "cpu" and _read_by_item(node)):
            self.add("forward-torch-op", f"calls the tensor method .{f.attr}() in run-time code", node)


def _unpacked(target: ast.AST, value: ast.AST | None) -> dict[str, ast.AST]:
    """``{name: value}`` of an assignment's target and value when each name gets one expression of the source:
    ``N = 4`` and the unpacking of a tuple or list literal of the same length (``D, H, W = 16, 32, 32``,
    ``(a, b), c = (1, 2), 3``); empty otherwise (a starred name, a value unpacked at run time)."""
    if isinstance(target, ast.Name) and value is not None:
        return {target.id: value}
    if not (isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
            and len(target.elts) == len(value.elts)):
        return {}
    out: dict[str, ast.AST] = {}
    for t, v in zip(target.elts, value.elts):
        if isinstance(t, ast.Starred) or isinstance(v, ast.Starred):
            return {}
        inner = _unpacked(t, v)
        if not inner:
            return {}
        out.update(inner)
    return out


def _dtype_name(value: object) -> str | None:
    """The dtype a ``.to`` / ``.type`` argument names (``torch.float16`` -> ``"float16"``, ``"torch.cuda.HalfTensor"``
    -> ``"float16"``), or None."""
    import torch

    if isinstance(value, str) and value.startswith("torch.") and not value.endswith("Tensor"):
        obj = _lookup(value)
        return str(obj).removeprefix("torch.") if isinstance(obj, torch.dtype) else None
    if isinstance(value, str):
        legacy = {"Half": "float16", "BFloat16": "bfloat16", "Double": "float64", "Float": "float32", "Long": "int64",
                  "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}
        kind = value.rsplit(".", 1)[-1].removesuffix("Tensor")
        return legacy.get(kind)
    return None


def _tensor_allocation(call: ast.Call) -> bool:
    """``torch.Tensor()`` (an empty tensor: a missing bias's placeholder), ``torch.Tensor(0)`` or
    ``torch.Tensor(n, m)`` with sizes (``x.size(0)``, ``x.shape[1]``, int literals): an allocation as ``torch.empty``
    is.  ``torch.Tensor(data)`` (a list, a tensor, a name the rules cannot size) is not."""
    def size(a: ast.AST) -> bool:
        if isinstance(a, ast.Constant):
            return type(a.value) is int
        if isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and a.func.attr in ("size", "numel", "dim"):
            return True
        return (isinstance(a, ast.Subscript) and isinstance(a.value, ast.Attribute) and a.value.attr == "shape") or (
            isinstance(a, ast.BinOp) and size(a.left) and size(a.right))

    return all(size(a) for a in call.args) and all(k.arg == "device" for k in call.keywords)


def _read_by_item(call: ast.Call) -> bool:
    """Whether ``call`` (``x.cpu()``) is at once read by ``.item()`` (``x.cpu().item()``): one value read onto the
    host, as ``x.item()`` reads it (run time allows it for a one-element tensor and replays it in the kernel
    ablation, :mod:`dice_ray.verify.trials.host_reads`)."""
    attr = getattr(call, "parent", None)
    user = getattr(attr, "parent", None)
    return (isinstance(attr, ast.Attribute) and attr.attr == "item" and attr.value is call
            and isinstance(user, ast.Call) and user.func is attr)


def _target_chain(node: ast.AST) -> list[ast.AST]:
    """The attribute, subscript and call nodes from an assignment target down to its root."""
    out = []
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        out.append(node)
        node = node.func if isinstance(node, ast.Call) else node.value
    return out


def _bound_names(node: ast.AST) -> set[str]:
    """Names a module or function binds itself (arguments, assignments, loops, imports, defs)."""
    out: set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = node.args
        out.update(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                                   *([a.kwarg] if a.kwarg else [])])
        body = [node.body] if isinstance(node, ast.Lambda) else node.body
    else:
        body = node.body  # type: ignore[attr-defined]
    stack = list(body)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
            continue  # its own scope
        if isinstance(n, ast.Lambda):
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
        stack.extend(ast.iter_child_nodes(n))
    return out


def _set_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node  # type: ignore[attr-defined]



def check_python(candidate: Candidate, input_dtypes: frozenset[str] | None = None) -> StaticReport:
    """The Python rules (see the module docstring) on a parsed candidate; parses nothing, runs nothing.

    Args:
        candidate: a :class:`~dice_ray.verify.candidate.candidate.Candidate` whose ``tree`` is not None; its tree
            gains ``parent`` links (every rule after this one may read them) and its dead code is not judged.
        input_dtypes: the dtypes the task's inputs may have (:func:`dice_ray.tasks.sizing.input_dtypes`): a cast to
            one of them is left to the run-time op check; None when the task is not known (float32 assumed).

    Returns:
        A :class:`~dice_ray.verify.rules.catalog.StaticReport` of the Python rules (format and ``kernel_refs``
        set), its violations in the order found.
    """
    assert candidate.tree is not None
    _set_parents(candidate.tree)
    checker = _Checker(candidate.tree, candidate.dead, inline=candidate.format == "inline", input_dtypes=input_dtypes)
    checker.check_module()
    return checker.report
