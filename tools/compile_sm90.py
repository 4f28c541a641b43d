"""Compile Triton and Gluon kernels for a GPU on a machine without one, to read what ptxas made of them.

    python tools/compile_sm90.py MODULE:FUNCTION [--arch 90] [--sass-dir DIR]

FUNCTION (no arguments) launches kernels as its code would, with CPU tensors of the real shapes and dtypes; every
launch only compiles (a warm-up) for `--arch` through Triton's own ptxas, and nothing runs. Printed per kernel:
shared memory bytes, registers and stack a thread (cuobjdump), the SASS instruction count and its local-memory
stores and loads (spills). `--sass-dir` writes each kernel's SASS there. The Gluon kernels are written for the
GPU machine's Triton (docs/kernels.md): compile them with that version installed (Gluon's API moves between
releases), plain Triton kernels with any.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class _CompileOnlyDriver:
    """What JITFunction.run asks the active driver for, answered for a GPU that is not there."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@dataclass
class Compiled:
    """One compiled kernel: its name, the compiled object (asm["cubin"], asm["ptx"], metadata)."""

    name: str
    kernel: object


def compile_launches(function, arch: int = 90) -> list[Compiled]:
    """Call `function`, turning every Triton / Gluon launch in it into a compile for sm`arch`; the kernels compiled.
    Triton's active driver stays the compile-only one: call it in a process of its own, as `main` does."""
    compiled: list[Compiled] = []
    run = JITFunction.run

    def warm_up(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        compiled.append(Compiled(self.fn.__name__, kernel))
        return kernel

    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run = warm_up
    try:
        function()
    finally:
        JITFunction.run = run
    return compiled


def report(item: Compiled, sass_dir: Path | None = None) -> str:
    """One line on a compiled kernel: shared bytes, registers / stack (cuobjdump), SASS instructions and spills."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(item.kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([tools / "nvdisasm", "-c", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    resources = " ".join(re.findall(r"(REG:\d+|STACK:\d+)", usage))
    instructions = [line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    spills = sum("STL" in line for line in instructions), sum("LDL" in line for line in instructions)
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / f"{item.name}.sass").write_text(sass)
    return (f"{item.name}: shared {item.kernel.metadata.shared} B, {resources}, {len(instructions)} SASS "
            f"instructions, {spills[0]} local stores / {spills[1]} loads")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="MODULE:FUNCTION, importable from the working directory")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, major and minor (default 90)")
    parser.add_argument("--sass-dir", type=Path, default=None, help="write each kernel's SASS here")
    args = parser.parse_args(argv)
    module, _, name = args.target.partition(":")
    if not name:
        parser.error(f"target {args.target!r}: expected MODULE:FUNCTION")
    sys.path.insert(0, str(Path.cwd()))
    function = getattr(importlib.import_module(module), name)
    for item in compile_launches(function, args.arch):
        print(report(item, args.sass_dir))


if __name__ == "__main__":
    main()
