"""Execution providers and session options: which device runs an artifact, and how."""
from __future__ import annotations

import functools
import os
from typing import Callable

import onnxruntime as ort

from .native_build import cpu_flags

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def choose_providers(provider: str = "auto", tf32: bool = False) -> list:
    """onnxruntime's provider list for ``auto`` / ``cpu`` / ``cuda``. On CUDA, TF32 is off
    unless asked (``tf32``): fp32 artifacts then match the CPU provider to ~1e-6, with it
    to ~1e-3."""
    available = ort.get_available_providers()
    if provider not in ("auto", "cpu", "cuda"):
        raise ValueError(f"provider must be auto, cpu or cuda, got {provider!r}")
    if provider == "cuda" and CUDA not in available:
        raise RuntimeError("provider 'cuda' requested but onnxruntime has no "
                           "CUDAExecutionProvider (install onnxruntime-gpu on a CUDA host)")
    if provider == "cpu" or CUDA not in available:
        return [CPU]
    _preload_cuda_libraries()
    return [(CUDA, {"use_tf32": "1" if tf32 else "0"}), CPU]


@functools.cache
def _preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries onnxruntime-gpu needs before its first CUDA session:
    where they come as Python packages (``nvidia-*``, or torch's) rather than from the
    system's library path, the CUDA provider finds them only so (onnxruntime's
    ``preload_dlls``; what it prints goes to the debug log)."""
    import contextlib
    import io
    import logging

    if not hasattr(ort, "preload_dlls"):
        return
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            ort.preload_dlls()
    except Exception as e:  # (a library it could not load: the session reports what is missing)
        said.write(f"{type(e).__name__}: {e}")
    if said.getvalue().strip():
        logging.getLogger(__name__).debug("onnxruntime.preload_dlls: %s", said.getvalue())


def provider_name(p) -> str:
    return p[0] if isinstance(p, tuple) else p


def device_of(providers: list) -> str:
    """The OrtValue device type of the first provider: ``cuda`` or ``cpu``."""
    return "cuda" if provider_name(providers[0]) == CUDA else "cpu"


def input_homes(sess: ort.InferenceSession, device: str) -> dict[str, str] | None:
    """Where ``sess`` reads each input: ``cpu`` or ``device`` (onnxruntime's memory info of
    the inputs, which a CUDA kernel may ask for in host memory); None where this onnxruntime
    cannot say (before the memory-info API)."""
    if device == "cpu":
        return {i.name: "cpu" for i in sess.get_inputs()}
    get = getattr(sess, "get_input_memory_infos", None)
    if get is None:
        return None
    try:
        infos = get()
    except Exception:  # (an onnxruntime that declares it but cannot answer)
        return None
    homes = {}
    for meta, info in zip(sess.get_inputs(), infos):
        name = str(info.name).lower()
        on_device = name.startswith("cuda") and "pinned" not in name and \
            info.mem_type == ort.OrtMemType.DEFAULT
        homes[meta.name] = device if on_device else "cpu"
    return homes


def bound_run(sess: ort.InferenceSession, binding: ort.IOBinding) -> Callable[[], None]:
    """A call that runs ``sess`` on ``binding``: onnxruntime's C++ entry point itself where the
    Python wrapper exposes it (as every release since 1.18 does), else the wrapper. The
    wrapper's own checks (WebGPU graph capture, run options) took ~8 us of a 380 us decode
    step of the 6M bench model, warm; up to ~25 us right after a pause."""
    c_sess, c_binding = getattr(sess, "_sess", None), getattr(binding, "_iobinding", None)
    if c_binding is not None and callable(getattr(c_sess, "run_with_iobinding", None)):
        # (the method is looked up at each call, on onnxruntime's C++ session class:
        # tests inject failures there)
        return lambda: c_sess.run_with_iobinding(c_binding, None)
    return functools.partial(sess.run_with_iobinding, binding)


def session_options(threads: int | None = None, spin: bool = True, prepack: bool = True
                    ) -> ort.SessionOptions:
    """``prepack=False``: the session keeps its weights as the artifact stores them instead of
    copying them into the kernels' packed layouts. On CPU onnxruntime then reads them from the
    memory-mapped data file, so the session holds no copy of its own (its matmuls pack per
    call: slower). For sessions used now and then next to the main one (diagnostics)."""
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or min(os.cpu_count() or 1, 8)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return so


def check_optimized_for(manifest: dict, providers: list) -> None:
    """An offline-optimised artifact runs only where it was made for (see export --optimize)."""
    tied = manifest.get("optimized_for")
    if not tied:
        return
    problems = []
    first = provider_name(providers[0])
    if first != tied.get("provider"):
        problems.append(f"provider {first} (optimised for {tied.get('provider')})")
    if tied.get("onnxruntime") != ort.__version__:
        problems.append(f"onnxruntime {ort.__version__} (optimised with "
                        f"{tied.get('onnxruntime')})")
    missing = sorted(set(tied.get("cpu_flags", [])) - cpu_flags())
    if missing:
        problems.append(f"this CPU lacks {', '.join(missing)}")
    if problems:
        raise RuntimeError("artifact was offline-optimised for another machine: "
                           + "; ".join(problems) + ". Re-export without --optimize or on "
                           "this machine.")
