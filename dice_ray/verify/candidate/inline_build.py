"""The load_inline format's compile pool: content-hash cache, parallel builds, limited compilers.

:class:`InlineBuilder` turns an :class:`~dice_ray.verify.candidate.inline_spec.InlineSpec` into what the
sandboxed worker loads, in the verifier's process (the worker may not fork or exec).  It writes
its own build instead of calling torch's ``load_inline`` (ninja + one nvcc of the whole
``torch/extension.h``: 53 s a candidate on the H200 host, 51 s for the nvcc step alone on the
2-core CPU machines):

* ``cuda.cu`` (the candidate's CUDA sources with launch counters) is compiled by ``nvcc -c``
  against *light torch headers*, falling back to the full ones when they lack a name
  (:mod:`dice_ray.verify.candidate.inline_files`: 51 s -> ~11 s a file on the 2-core CPU machines).
* ``main.cpp`` (``cpp_sources`` + pybind11 bindings of ``functions`` + the counter readers) is
  compiled by ``g++ -c`` against a *precompiled header* of ``torch/extension.h`` built once per
  toolchain (~40-50 s, ~0.75 GB on disk; 16 s -> ~6-11 s a ``main.cpp`` there), at the header's ``-O``
  level whatever ``extra_cflags`` say (:func:`~dice_ray.verify.candidate.toolchain.main_flags`); should g++
  crash on the header all the same, the file is compiled again without it.  ``main.o`` and
  ``cuda.o`` have their own content keys: an RL group whose samples share ``cpp_sources`` (DICE's
  infilling prompts: only the CUDA ``source`` differs) compiles ``main.cpp`` once.
* On a GPU machine the two objects are linked (``g++ -shared``, torch's and CUDA's library
  folders) into ``lib/<key>.so``; in compile-only mode (a CPU-only torch has no
  ``libtorch_cuda``) the build stops at the objects, so CI still checks that candidates compile.
  With ``link_vendor_libraries`` (``VerifyConfig.allow_vendor_libraries``) the link adds the vendor
  math libraries the spec uses (:meth:`~dice_ray.verify.candidate.inline_spec.InlineSpec.vendor_libraries`),
  found where torch's own copies are (the ``nvidia-*`` wheels' ``lib`` folders first, then torch's
  and CUDA's library folders) and found again at load time through an rpath.

Cache: ``<cache_dir>/<toolchain key>/`` with ``obj/`` (``<key>.o`` or ``<key>.err``: compile errors
are cached too, a compiler crash, :data:`~dice_ray.verify.candidate.limited_run.INTERNAL_ERROR`, is not), ``lib/``, ``pch/``, ``include/`` and ``tmp/`` (one unique build folder per
compile, its outputs moved into place with an atomic ``os.replace``, so concurrent builders, in
threads or processes, never see half-written files).  The toolchain key hashes the nvcc and g++
versions, torch's version and include folder, the Python ABI and the build options.  Identical
specs (same content key) in flight at once are built once (per-key futures); different specs build
in parallel, at most ``max_builds`` at a time.

Every compiler runs under a hard wall-clock limit and ``RLIMIT_CPU`` / ``RLIMIT_AS`` /
``RLIMIT_FSIZE`` (:func:`dice_ray.verify.candidate.limited_run.run_limited`): a compile bomb (deep
template recursion) ends as a ``compile_error`` whose reason says which limit, and never hangs
the verifier.

Measured on the H200 machine (16 cores; DICE infilling records, cold): ``cuda.cu`` ~16-19 s,
``main.cpp`` ~8-10 s beside it, link 0.4 s: ~19 s a candidate, 8 at a time; the precompiled
header 36-38 s once per toolchain; a cache hit ~1 ms (torch's ``load_inline``: 53 s).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dice_ray.verify.candidate.inline_counters import instrument_cuda
from dice_ray.verify.candidate.inline_files import LITE_MISS, cuda_file, main_file, write_headers
from dice_ray.verify.candidate.inline_spec import InlineSpec
from dice_ray.verify.candidate.limited_run import INTERNAL_ERROR, run_limited
from dice_ray.verify.candidate.toolchain import (
    Toolchain,
    cuda_command,
    detect_toolchain,
    link_command,
    main_command,
    module_name,
    rename_init_command,
    sha,
)

__all__ = ["BuildResult", "InlineBuilder", "default_cache_dir", "device_arch"]

_CREATE_LOCK = threading.Lock()


def default_cache_dir() -> Path:
    """``$DICE_RAY_INLINE_CACHE``, else ``$XDG_CACHE_HOME/dice-ray/inline``, else ``~/.cache/dice-ray/inline``."""
    env = os.environ.get("DICE_RAY_INLINE_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dice-ray" / "inline"


def device_arch(device: int) -> str:
    """``sm_XY`` of CUDA device ``device`` through the driver API: no CUDA context is created in
    the calling process (the verifier's parent must not take GPU memory)."""
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
        err, dev = driver.cuDeviceGet(device)
        if int(err) == 0:
            attr = driver.CUdevice_attribute
            e1, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            e2, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
            if int(e1) == 0 and int(e2) == 0:
                return f"sm_{major}{minor}"
    except Exception:  # noqa: BLE001 - fall back to torch (initialises CUDA here)
        pass
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@dataclass
class _Obj:
    """One compile step's outcome (an object file, or why there is none)."""

    ok: bool
    kind: str  # ok | compile_error | timeout | limit
    path: str | None = None
    log: str = ""
    seconds: float = 0.0
    cached: bool = False
    lite: bool | None = None


@dataclass
class BuildResult:
    """What :meth:`InlineBuilder.build` returns for one spec.

    Attributes:
        key: content hash of the whole build (sources, functions, flags, arch, toolchain).
        ok: both objects compiled (and, when linking, the ``.so`` exists).
        kind: ``"ok"``, ``"compile_error"`` (log in ``log``), ``"timeout"`` (wall limit) or
            ``"limit"`` (CPU time, memory or file size limit).
        module: the extension's ``PyInit_`` name (``dice_<main.o key prefix>``).
        path: the linked ``.so`` (None in compile-only mode or on failure).
        objects: the object files (``main.o``, ``cuda.o``).
        log: the failing compiler's output (the nvcc / g++ log), clipped to 20k characters.
        seconds: wall time of this call (s): a cold build, or the lookup of a cache hit.
        cached: every part came from the cache (memory or disk).
        lite: ``cuda.cu`` compiled with the lite torch header (False: fell back to the full one).
        counting: ``"host"`` or ``"device"`` (see :func:`dice_ray.verify.candidate.inline_counters.instrument_cuda`).
        kernels: the ``__global__`` functions that got a counter.
        has_cuda: the spec has CUDA sources.
    """

    key: str
    ok: bool
    kind: str
    module: str | None = None
    path: str | None = None
    objects: tuple[str, ...] = ()
    log: str = ""
    seconds: float = 0.0
    cached: bool = False
    lite: bool | None = None
    counting: str = "host"
    kernels: tuple[str, ...] = ()
    has_cuda: bool = True
    parts: dict[str, float] = field(default_factory=dict)

    def job_entry(self, spec: InlineSpec) -> dict[str, Any]:
        """The worker's description of this module (``job["inline"]["modules"][i]``)."""
        return {"key": spec.key(), "name": spec.name, "module": self.module, "path": self.path,
                "counting": self.counting, "has_cuda": self.has_cuda, "kernels": list(self.kernels)}

    def reason(self) -> str:
        """A verdict reason: what failed and the compiler log."""
        what = {"compile_error": "compile error", "timeout": "compile timeout",
                "limit": "compiler resource limit"}.get(self.kind, self.kind)
        return f"load_inline build failed ({what}):\n{self.log.strip()}"


class InlineBuilder:
    """Compiles load_inline specs in parallel, with a content-hash cache (see the module docstring).

    Thread-safe: :meth:`build` / :meth:`submit` may be called from many threads at once.

    Args:
        cache_dir: cache root (None: :func:`default_cache_dir`).
        arch: ``sm_XY`` target (``device_arch(device)`` on a GPU machine, ``VerifyConfig.arch`` else).
        link: build and link the ``.so`` (GPU machines); False: object files only (compile-only).
        max_builds: specs compiled at once (each runs its g++ and its nvcc side by side);
            0: half the CPU cores, at least 1.
        timeout_s: wall-clock limit of one compiler process (s).
        cpu_s: ``RLIMIT_CPU`` of one compiler process (s).
        memory_gib: ``RLIMIT_AS`` of one compiler process (GiB; nvcc on the full torch headers
            peaks near 3 GiB resident).
        file_mib: ``RLIMIT_FSIZE`` of one compiler process (MiB; its log file included).
        lite_headers: compile ``cuda.cu`` with the lite torch header first.
        pch: precompile ``torch/extension.h`` for ``main.cpp`` (once per toolchain).
        host_opt: optimisation flag of host code (``main.cpp`` and nvcc's host side; device code
            is always ``-O3``).
        link_vendor_libraries: link the vendor libraries a spec uses (see the module docstring);
            False (the default, vendor libraries refused by the rules): never.

    Raises:
        OSError: the cache folder cannot be created.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, *, arch: str = "sm_90", link: bool = True,
                 max_builds: int = 0, timeout_s: float = 300.0, cpu_s: float = 600.0, memory_gib: float = 8.0,
                 file_mib: float = 512.0, lite_headers: bool = True, pch: bool = True, host_opt: str = "-O1",
                 link_vendor_libraries: bool = False):
        if not re.fullmatch(r"sm_\d+a?", arch):
            raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
        if host_opt not in ("-O0", "-O1", "-O2", "-O3"):
            raise ValueError(f"host_opt must be -O0..-O3, got {host_opt!r}")
        self.arch = arch
        self.link = link
        self.max_builds = max_builds or max(1, (os.cpu_count() or 2) // 2)
        self.timeout_s, self.cpu_s = timeout_s, cpu_s
        self.memory_bytes = int(memory_gib * 2**30)
        self.file_bytes = int(file_mib * 2**20)
        self.lite_headers, self.use_pch, self.host_opt = lite_headers, pch, host_opt
        self.link_vendor_libraries = link_vendor_libraries
        self._vendor_paths: dict[str, Path | None] = {}
        self.tc: Toolchain = detect_toolchain(host_opt, lite_headers, pch)
        self.root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.dir = self.root / self.tc.key
        for sub in ("obj", "lib", "pch", "include", "tmp"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        write_headers(self.dir / "include", self.tc.torch_includes)
        self._lock = threading.Lock()
        self._pch_lock = threading.Lock()
        self._pch_state: str | None = None  # None: not tried; "ok"; "off"
        self._results: OrderedDict[str, Future] = OrderedDict()
        self._objects: OrderedDict[str, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(self.max_builds, thread_name_prefix="inline-build")
        self._obj_pool = ThreadPoolExecutor(self.max_builds, thread_name_prefix="inline-main")
        self._stats: dict[str, float] = {"builds": 0, "hits": 0, "waits": 0, "failures": 0, "cold_s": 0.0,
                                         "hit_s": 0.0, "pch_s": 0.0, "main_compiles": 0, "cuda_compiles": 0,
                                         "lite_fallbacks": 0, "main_s": 0.0, "cuda_s": 0.0, "link_s": 0.0}
        self._closed = False

    # -- public -----------------------------------------------------------------------------------
    @classmethod
    def create_once(cls, owner: Any, attr: str, factory: Callable[[], "InlineBuilder"]) -> "InlineBuilder":
        """``getattr(owner, attr)``, created with ``factory()`` under a process-wide lock the first
        time (how a Verifier makes its builder lazily from several threads); the builder is closed
        when ``owner`` is garbage-collected."""
        b = getattr(owner, attr, None)
        if b is None:
            with _CREATE_LOCK:
                b = getattr(owner, attr, None)
                if b is None:
                    import weakref

                    b = factory()
                    setattr(owner, attr, b)
                    weakref.finalize(owner, b.close)
        return b

    def key(self, spec: InlineSpec) -> str:
        """The build's content key (as :attr:`BuildResult.key`) without building."""
        return self._keys(spec, instrument_cuda(spec.cuda_source) if spec.cuda_sources else None)[2]

    def submit(self, spec: InlineSpec) -> Future:
        """Start building ``spec`` (or join the build in flight with the same key); a Future of
        :class:`BuildResult`.  Never raises for a bad spec: failures are results."""
        t0 = time.perf_counter()
        inst = instrument_cuda(spec.cuda_source) if spec.cuda_sources else None
        main_key, cuda_key, key = self._keys(spec, inst)
        with self._lock:
            if self._closed:
                raise RuntimeError("InlineBuilder is closed")
            fut = self._results.get(key)
            joined = fut is not None
            if joined:
                self._results.move_to_end(key)
                self._stats["waits" if not fut.done() else "hits"] += 1
            else:
                fut = Future()
                self._results[key] = fut
                while len(self._results) > 4096:
                    self._results.popitem(last=False)
        if joined:
            return self._hit(fut.result(), t0) if fut.done() else fut
        hit = self._disk_hit(spec, inst, main_key, cuda_key, key)
        if hit is not None:
            hit.seconds = time.perf_counter() - t0
            with self._lock:
                self._stats["hits"] += 1
                self._stats["hit_s"] += hit.seconds
            fut.set_result(hit)
            return fut
        self._pool.submit(self._run_build, fut, spec, inst, main_key, cuda_key, key, t0)
        return fut

    def build(self, spec: InlineSpec) -> BuildResult:
        """Build ``spec`` and wait (see :meth:`submit`)."""
        return self.submit(spec).result()

    def stats(self) -> dict[str, float]:
        """Counters and timings: ``builds`` (cold), ``hits`` (memory or disk), ``waits`` (joined a
        build in flight), ``failures``, ``cold_s_mean`` / ``hit_s_mean`` (s a build / a hit),
        ``pch_s`` (precompiled header, once), ``main_s`` / ``cuda_s`` / ``link_s`` (compiler
        seconds summed), ``lite_fallbacks``, ``max_builds``."""
        with self._lock:
            s = dict(self._stats)
        s["cold_s_mean"] = s["cold_s"] / s["builds"] if s["builds"] else 0.0
        s["hit_s_mean"] = s["hit_s"] / s["hits"] if s["hits"] else 0.0
        s["max_builds"] = self.max_builds
        return s

    def close(self) -> None:
        """Stop accepting builds; running compilers finish (their processes are not orphaned)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._obj_pool.shutdown(wait=False, cancel_futures=True)

    # -- keys and cache ----------------------------------------------------------------------------
    def _keys(self, spec: InlineSpec, inst: Any) -> tuple[str, str | None, str]:
        has_cuda = bool(spec.cuda_sources)
        main_key = sha("main", self.tc.key, spec.cpp_sources, spec.functions, spec.extra_cflags, has_cuda,
                       spec.no_implicit_headers)
        cuda_key = sha("cuda", self.tc.key, self.arch, inst.source, spec.extra_cuda_cflags,
                        spec.no_implicit_headers) if inst is not None else None
        libs = self._vendor_libs(spec)
        return main_key, cuda_key, sha("so", main_key, cuda_key, self.link, *([libs] if libs else []))

    # -- vendor libraries (link flags) -------------------------------------------------------------
    def _vendor_libs(self, spec: InlineSpec) -> tuple[str, ...]:
        """The vendor libraries ``spec``'s ``.so`` links (none unless linking with vendor libraries on)."""
        if not (self.link and self.link_vendor_libraries):
            return ()
        return spec.vendor_libraries()

    def _vendor_path(self, lib: str) -> Path | None:
        """``lib<lib>.so`` (or the highest ``lib<lib>.so.N``) in the ``nvidia-*`` wheels' ``lib``
        folders, then in the toolchain's library folders; None when absent (memoised)."""
        if lib not in self._vendor_paths:
            import glob
            import importlib.util

            dirs: list[str] = []
            spec = importlib.util.find_spec("nvidia")
            for root in (spec.submodule_search_locations or []) if spec is not None else []:
                dirs += sorted(glob.glob(os.path.join(root, "*", "lib")) + glob.glob(os.path.join(root, "*", "lib64")))
            dirs += list(self.tc.lib_dirs)
            found = None
            for d in dirs:
                exact = Path(d) / f"lib{lib}.so"
                versioned = sorted(Path(d).glob(f"lib{lib}.so.*"), key=lambda p: [int(x) if x.isdigit() else 0
                                                                                   for x in p.name.split(".")[2:]])
                if exact.exists() or versioned:
                    found = exact if exact.exists() else versioned[-1]
                    break
            self._vendor_paths[lib] = found
        return self._vendor_paths[lib]

    def vendor_link_args(self, spec: InlineSpec) -> list[str]:
        """Link flags for the vendor libraries of ``spec`` (empty unless ``link`` and
        ``link_vendor_libraries``): ``-L<dir> -Wl,-rpath,<dir> -l:<file>`` for each library found;
        a library named in ``extra_ldflags`` but not found is passed as ``-l<name>`` (the linker
        then reports it, as torch's load_inline would); one only seen in the sources and not found
        is left out (its symbols resolve at load time from the copy torch has loaded)."""
        out: list[str] = []
        for lib in self._vendor_libs(spec):
            path = self._vendor_path(lib)
            if path is not None:
                out += [f"-L{path.parent}", f"-Wl,-rpath,{path.parent}", f"-l:{path.name}"]
            elif f"-l{lib}" in spec.extra_ldflags:
                out.append(f"-l{lib}")
        return out

    def _hit(self, r: BuildResult, t0: float) -> Future:
        f: Future = Future()
        seconds = time.perf_counter() - t0
        with self._lock:
            self._stats["hit_s"] += seconds
        f.set_result(BuildResult(**{**r.__dict__, "seconds": seconds, "cached": True}))
        return f

    def _obj_path(self, key: str) -> Path:
        return self.dir / "obj" / f"{key}.o"

    def _disk_obj(self, key: str) -> _Obj | None:
        p = self._obj_path(key)
        if p.exists():
            meta = self._read_meta(key)
            return _Obj(True, "ok", str(p), cached=True, lite=meta.get("lite"))
        err = self.dir / "obj" / f"{key}.err"
        if err.exists():
            try:
                d = json.loads(err.read_text())
                return _Obj(False, d.get("kind", "compile_error"), None, d.get("log", ""), cached=True)
            except (OSError, ValueError):
                return None
        return None

    def _read_meta(self, key: str) -> dict[str, Any]:
        try:
            return json.loads((self.dir / "obj" / f"{key}.json").read_text())
        except (OSError, ValueError):
            return {}

    def _disk_hit(self, spec: InlineSpec, inst: Any, main_key: str, cuda_key: str | None, key: str) -> BuildResult | None:
        main = self._disk_obj(main_key)
        cuda = self._disk_obj(cuda_key) if cuda_key else _Obj(True, "ok")
        if main is None or cuda is None:
            return None
        for o in (cuda, main):
            if not o.ok:
                return self._result(spec, inst, main_key, key, o, cached=True)
        so = self.dir / "lib" / f"{key}.so"
        if self.link and not so.exists():
            return None
        return self._result(spec, inst, main_key, key, _Obj(True, "ok", lite=cuda.lite), cached=True,
                            objects=(str(self._obj_path(main_key)),) + ((str(self._obj_path(cuda_key)),) if cuda_key else ()),
                            so=str(so) if self.link else None)

    def _result(self, spec: InlineSpec, inst: Any, main_key: str, key: str, o: _Obj, cached: bool = False,
                objects: tuple[str, ...] = (), so: str | None = None) -> BuildResult:
        return BuildResult(key=key, ok=o.ok, kind=o.kind, module=module_name(key), path=so, objects=objects,
                           log=o.log, cached=cached, lite=o.lite, counting=inst.counting if inst else "host",
                           kernels=inst.kernels if inst else (), has_cuda=inst is not None)

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    # -- building ----------------------------------------------------------------------------------
    def _run_build(self, fut: Future, spec: InlineSpec, inst: Any, main_key: str, cuda_key: str | None, key: str,
                   t0: float) -> None:
        try:
            r = self._build(spec, inst, main_key, cuda_key, key)
        except BaseException as e:  # noqa: BLE001 - a builder bug still yields one result
            r = self._result(spec, inst, main_key, key, _Obj(False, "compile_error",
                                                             log=f"internal build error: {type(e).__name__}: {e}"))
        r.seconds = time.perf_counter() - t0
        with self._lock:
            if r.cached:
                self._stats["hits"] += 1
                self._stats["hit_s"] += r.seconds
            else:
                self._stats["builds"] += 1
                self._stats["cold_s"] += r.seconds
            if not r.ok:
                self._stats["failures"] += 1
        fut.set_result(r)

    def _build(self, spec: InlineSpec, inst: Any, main_key: str, cuda_key: str | None, key: str) -> BuildResult:
        modname = module_name(main_key)
        main_fut = self._obj_pool.submit(self._object, main_key,
                                         lambda: self._compile_main(spec, modname, inst is not None, main_key))
        cuda = (self._object(cuda_key, lambda: self._compile_cuda(spec, inst.source, cuda_key)) if cuda_key
                else _Obj(True, "ok", cached=True))
        if not cuda.ok:
            return self._result(spec, inst, main_key, key, cuda, cached=cuda.cached)
        main = main_fut.result()
        if not main.ok:
            return self._result(spec, inst, main_key, key, main, cached=main.cached)
        objects = (main.path,) + ((cuda.path,) if cuda_key else ())
        assert all(objects)
        so = None
        cached = main.cached and cuda.cached
        if self.link:
            so_path = self.dir / "lib" / f"{key}.so"
            if not so_path.exists():
                cached = False
                linked = self._link(objects, so_path, self.vendor_link_args(spec),  # type: ignore[arg-type]
                                    rename=(modname, module_name(key)))
                if not linked.ok:
                    return self._result(spec, inst, main_key, key, linked)
            so = str(so_path)
        return self._result(spec, inst, main_key, key, _Obj(True, "ok", lite=cuda.lite), cached=cached,
                            objects=objects, so=so)  # type: ignore[arg-type]

    def _object(self, key: str, compile_fn: Callable[[], _Obj]) -> _Obj:
        """One object file by content key: from memory, disk, a compile in flight, or compiled here."""
        with self._lock:
            fut = self._objects.get(key)
            owner = fut is None
            if owner:
                fut = Future()
                self._objects[key] = fut
                while len(self._objects) > 4096:
                    self._objects.popitem(last=False)
        assert fut is not None
        if not owner:
            return fut.result()
        try:
            o = self._disk_obj(key)
            if o is None:
                o = compile_fn()
                if o.kind == "compile_error" and not INTERNAL_ERROR.search(o.log):
                    # the candidate's error is deterministic: cache it (timeouts, limits and compiler crashes are not)
                    self._write_atomic(self.dir / "obj" / f"{key}.err",
                                       json.dumps({"kind": o.kind, "log": o.log}).encode())
            fut.set_result(o)
        except BaseException as e:  # noqa: BLE001
            fut.set_result(_Obj(False, "compile_error", log=f"internal build error: {type(e).__name__}: {e}"))
        return fut.result()

    def _tmpdir(self, tag: str) -> Path:
        d = self.dir / "tmp" / f"{tag}-{uuid.uuid4().hex[:12]}"
        d.mkdir(parents=True)
        return d

    def _run(self, cmd: list[str], cwd: Path, file_bytes: int | None = None) -> tuple[str, str, float]:
        """One compiler under this builder's limits (:func:`~dice_ray.verify.candidate.limited_run.run_limited`)."""
        return run_limited(cmd, cwd, timeout_s=self.timeout_s, cpu_s=int(self.cpu_s), memory_bytes=self.memory_bytes,
                           file_bytes=self.file_bytes if file_bytes is None else file_bytes)

    def _pch(self) -> Path | None:
        """The precompiled ``torch/extension.h`` (built once per toolchain, shared by processes)."""
        if not self.use_pch:
            return None
        header = self.dir / "pch" / "dice_torch.h"
        gch = self.dir / "pch" / "dice_torch.h.gch"
        with self._pch_lock:
            if self._pch_state == "off":
                return None
            if self._pch_state == "ok" or gch.exists():
                self._pch_state = "ok"
                return header
            with open(self.dir / "pch" / ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it
                try:
                    if not gch.exists():
                        if not header.exists():
                            self._write_atomic(header, b"#pragma once\n#include <torch/extension.h>\n")
                        tmp = self._tmpdir("pch")
                        try:
                            cmd = main_command(self.tc, self.host_opt, (), source=str(header),
                                               include_dir=self.dir / "include",
                                               out=str(tmp / "dice_torch.h.gch"))
                            kind, log, secs = self._run(cmd, tmp, file_bytes=4 * 2**30)  # the .gch is ~0.75 GB
                            with self._lock:
                                self._stats["pch_s"] += secs
                            if kind != "ok":
                                self._pch_state = "off"
                                return None
                            os.replace(tmp / "dice_torch.h.gch", gch)
                        finally:
                            shutil.rmtree(tmp, ignore_errors=True)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            self._pch_state = "ok"
            return header

    def _compile_main(self, spec: InlineSpec, modname: str, has_cuda: bool, key: str) -> _Obj:
        pch = None if spec.no_implicit_headers else self._pch()
        tmp = self._tmpdir("main")
        try:
            (tmp / "inline_build.cpp").write_text(main_file(spec, modname, has_cuda))
            inc = self.dir / "include"
            kind, log, secs = self._run(main_command(self.tc, self.host_opt, spec.extra_cflags, pch, include_dir=inc), tmp)
            if kind == "compile_error" and pch is not None and INTERNAL_ERROR.search(log):
                # g++ crashed on the precompiled header, not on the candidate: once more without it
                kind, log, more = self._run(main_command(self.tc, self.host_opt, spec.extra_cflags, include_dir=inc), tmp)
                secs += more
            with self._lock:
                self._stats["main_compiles"] += 1
                self._stats["main_s"] += secs
            return self._store(kind, log, secs, tmp / "main.o", key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _store(self, kind: str, log: str, secs: float, out: Path, key: str, lite: bool | None = None) -> _Obj:
        if kind != "ok":
            return _Obj(False, kind, None, log, secs, lite=lite)
        dest = self._obj_path(key)
        if lite is not None:
            self._write_atomic(self.dir / "obj" / f"{key}.json", json.dumps({"lite": lite}).encode())
        os.replace(out, dest)
        return _Obj(True, "ok", str(dest), log, secs, lite=lite)

    def _compile_cuda(self, spec: InlineSpec, source: str, key: str) -> _Obj:
        attempts = [True, False] if self.lite_headers else [False]
        kind, log, secs, tmp, total = "compile_error", "", 0.0, None, 0.0
        try:
            for lite in attempts:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                tmp = self._tmpdir("cuda")
                (tmp / "inline_build.cu").write_text(cuda_file(spec, source, lite))
                cmd = cuda_command(self.tc, self.arch, self.host_opt, self.dir / "include", f"dice_{key[:20]}",
                                   spec.extra_cuda_cflags)
                kind, log, secs = self._run(cmd, tmp)
                total += secs
                if kind == "ok" or not lite or kind != "compile_error" or not LITE_MISS.search(log):
                    break
                with self._lock:
                    self._stats["lite_fallbacks"] += 1
            with self._lock:
                self._stats["cuda_compiles"] += 1
                self._stats["cuda_s"] += total
            assert tmp is not None
            return self._store(kind, log, total, tmp / "cuda.o", key, lite=lite)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _link(self, objects: tuple[str, ...], so_path: Path, extra: list[str] | None = None,
              rename: tuple[str, str] | None = None) -> _Obj:
        """Link ``objects`` (main.o first) into ``so_path``; ``rename=(shared, own)``: the extension's init
        function is renamed from main.o's ``PyInit_<shared>`` to ``PyInit_<own>`` in a copy of main.o
        (:func:`~dice_ray.verify.candidate.toolchain.rename_init_command`), so every ``.so`` is a module of its own
        name: main.o is shared by the candidates whose ``cpp_sources`` are the same, and a worker that
        imported one of them got that first module again for the others (their own CUDA code never ran)."""
        tmp = self._tmpdir("link")
        try:
            secs = 0.0
            if rename is not None:
                kind, log, secs = self._run(rename_init_command(objects[0], "main.o", *rename), tmp)
                if kind != "ok":
                    return _Obj(False, kind, None, f"renaming the module's init function failed:\n{log}", secs)
                objects = (str(tmp / "main.o"), *objects[1:])
            cmd = link_command(self.tc, objects, "ext.so", cuda=len(objects) > 1) + list(extra or ())
            kind, log, link_secs = self._run(cmd, tmp)
            secs += link_secs
            with self._lock:
                self._stats["link_s"] += secs
            if kind != "ok":
                return _Obj(False, kind, None, f"link failed:\n{log}", secs)
            os.replace(tmp / "ext.so", so_path)
            return _Obj(True, "ok", str(so_path), log, secs)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
