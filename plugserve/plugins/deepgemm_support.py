"""What the two DeepGEMM backends (gemm `deepgemm`, moe `deepgemm`) ask of the machine, in one place.

DeepGEMM (deepseek-ai/DeepGEMM, v2.6 or newer; built from source, see tools/device/build_deepgemm.sh) compiles its
kernels at run time with nvcc. Its sm90 kernels take float32 scales: 1 x 128 per token group for activations
and 128 x 128 per weight block, the checkpoint's own. On sm100 it wants UE8M0 (power-of-two) scales, which
would re-quantize the checkpoint: the backends run on sm90 only.

The libstdc++ trap: DeepGEMM's extension lists torch's libraries before libstdc++ among its dependencies,
and PyTorch's wheels export their own, statically linked copies of some libstdc++ functions. Unless
libstdc++ is first in the process's global symbol scope (LD_PRELOAD puts it there), the dynamic linker binds
part of DeepGEMM's C++ runtime calls to those copies, and its JIT compiler segfaults in std::regex on its
first kernel. `libstdcxx_problem` recognizes that setup from facts any process can read about itself
without running DeepGEMM: the libstdc++ files /proc/self/maps lists, and which file the global scope
resolves libstdc++'s symbols to (dlsym + dladdr).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

from plugserve.core.hardware import Hardware
from plugserve.core.interfaces import OK, Availability

MIN_VERSION = (2, 6)  # the API the backends call (psum layout of the contiguous grouped GEMM) as of v2.6.1
SM90 = (9, 0)
BUILD_HINT = ("build DeepGEMM v2.6.1 from source with tools/device/build_deepgemm.sh and put its folder on PYTHONPATH "
              "(PyPI's deep-gemm is not it)")
# libstdc++ symbols the global scope must resolve to libstdc++ itself: one every libstdc++ has and no other
# library copies, and one PyTorch's wheels carry a copy of (torch's copy wins if torch is global first).
PROBE_SYMBOLS = {
    "_ZNSt6locale7classicEv": "std::locale::classic()",
    "_ZNKSt10filesystem7__cxx114path7compareERKS1_": "std::filesystem::path::compare(path const&)",
}


def is_libstdcxx(path: str) -> bool:
    return os.path.basename(path).startswith("libstdc++.so")


def mapped_libstdcxx(maps: str) -> list[str]:
    """The libstdc++ files a /proc/<pid>/maps text lists, each once, in order of first appearance."""
    found: dict[str, None] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and is_libstdcxx(fields[5].removesuffix(" (deleted)")):
            found[fields[5].removesuffix(" (deleted)")] = None
    return list(found)


def libstdcxx_problem(mapped: Sequence[str], providers: Mapping[str, str | None]) -> str | None:
    """Why DeepGEMM's JIT would segfault in this process, or None when it would not.

    mapped: the libstdc++ files loaded (real paths, `mapped_libstdcxx`); providers: for each probe symbol
    that libstdc++ defines, the file the global scope resolves it to (None: no globally visible object
    defines it, as when libstdc++ was loaded only as a dependency of torch's libraries)."""
    if not mapped:
        return None  # no C++ runtime loaded: nothing DeepGEMM could bind to the wrong copy yet
    fix = f"start the process with LD_PRELOAD={mapped[0]}"
    if len(mapped) > 1:
        return f"two C++ runtimes are loaded ({', '.join(mapped)}): DeepGEMM's JIT would segfault in std::regex; {fix}"
    for symbol, provider in providers.items():
        if provider is None or not is_libstdcxx(provider):
            where = "is not in the global symbol scope" if provider is None else f"resolves to {provider}"
            return (f"libstdc++ is not preloaded ({PROBE_SYMBOLS.get(symbol, symbol)} {where}): DeepGEMM's "
                    "extension would bind C++ runtime calls to the copies inside torch's libraries, and its JIT "
                    f"would segfault in std::regex; {fix}")
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def global_provider(symbol: str) -> str | None:
    """The file whose definition of `symbol` the process's global scope gives (what a library loaded now
    binds to first), or None when no globally visible object defines it. Only looks symbols up."""
    process = ctypes.CDLL(None)  # dlsym on the main program's handle searches the global scope
    try:
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p).value
        dladdr = process.dladdr
    except AttributeError:
        return None
    info = _DlInfo()
    if not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def libstdcxx_check(maps_path: str = "/proc/self/maps") -> str | None:
    """`libstdcxx_problem` for this process. Reads its memory map and looks symbols up; runs nothing of
    DeepGEMM, so it cannot crash the process it probes. None where there is no /proc (not Linux)."""
    try:
        maps = Path(maps_path).read_text()
    except OSError:
        return None
    mapped = list(dict.fromkeys(os.path.realpath(path) for path in mapped_libstdcxx(maps)))
    if len(mapped) != 1:
        return libstdcxx_problem(mapped, {})
    try:
        runtime = ctypes.CDLL(mapped[0])  # already loaded: dlopen returns it, and RTLD_LOCAL changes nothing
        defined = [symbol for symbol in PROBE_SYMBOLS if hasattr(runtime, symbol)]
    except OSError:  # cannot tell which probes it defines: ask about all of them
        defined = list(PROBE_SYMBOLS)
    return libstdcxx_problem(mapped, {symbol: global_provider(symbol) for symbol in defined})


def nvcc_path(environ: Mapping[str, str], which: Callable[[str], str | None] = shutil.which) -> Path:
    """The nvcc DeepGEMM's JIT runs: $DG_JIT_NVCC_COMPILER, else bin/nvcc of the CUDA home it finds as its
    __init__ does ($CUDA_HOME, $CUDA_PATH, the nvcc on PATH, /usr/local/cuda)."""
    if environ.get("DG_JIT_NVCC_COMPILER"):
        return Path(environ["DG_JIT_NVCC_COMPILER"])
    cuda_home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if not cuda_home:
        found = which("nvcc")
        cuda_home = str(Path(found).parent.parent) if found else "/usr/local/cuda"
    return Path(cuda_home) / "bin" / "nvcc"


def parse_version(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def import_deep_gemm() -> ModuleType:
    import deep_gemm  # the optional package, imported only here

    return deep_gemm


def deepgemm_availability(hardware: Hardware, hardware_fit: Availability) -> Availability:
    """Can DeepGEMM's sm90 kernels run in this process? `hardware_fit` is the backend's
    capabilities.check_hardware result (its super().availability), refined with why sm100 is refused.
    Imports deep_gemm (safe: only its kernels' first compilation crashes in the libstdc++ trap)."""
    if not hardware_fit:
        if hardware.capability is not None and hardware.capability > SM90:
            return Availability.no(f"{hardware_fit.reason}: on {hardware.arch} DeepGEMM takes UE8M0 (power-of-two) "
                                   "scales, which would re-quantize the checkpoint; this backend runs its sm90 "
                                   "kernels on the checkpoint's float32 scales")
        return hardware_fit
    try:
        deep_gemm = import_deep_gemm()
    except ImportError as exc:
        return Availability.no(f"deep_gemm is not installed ({exc}); {BUILD_HINT}")
    except Exception as exc:  # its __init__ asserts a CUDA home, initializes its C++ runtime
        return Availability.no(f"import deep_gemm failed: {type(exc).__name__}: {exc}")
    version = getattr(deep_gemm, "__version__", "unknown")
    parsed = parse_version(version)
    if parsed is None or parsed < MIN_VERSION:
        return Availability.no(f"deep_gemm {version} is too old: needs {MIN_VERSION[0]}.{MIN_VERSION[1]} or newer; "
                               f"{BUILD_HINT}")
    if os.environ.get("DG_JIT_USE_NVRTC", "0") in ("", "0"):
        nvcc = nvcc_path(os.environ)
        if not nvcc.is_file():
            return Availability.no(f"DeepGEMM compiles its kernels with nvcc at run time, and {nvcc} does not exist "
                                   "(set CUDA_HOME to the CUDA toolkit, or DG_JIT_USE_NVRTC=1)")
    problem = libstdcxx_check()
    return Availability.no(problem) if problem else OK
