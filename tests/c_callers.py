"""Compiling a C program against a `flowgen build --lib` library, for the tests that call the C API."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_c(source, out, manifest, binary, *flags):
    """gcc -std=c99 with every warning an error: `source` linked with the library in `out` (its
    header passed as FLOWGEN_MODEL_HEADER, the library found through rpath)."""
    name = manifest["name"]
    command = ["gcc", "-std=c99", "-Wall", "-Wextra", "-Werror", *flags, str(source), f"-I{out}",
               f'-DFLOWGEN_MODEL_HEADER="{manifest["header"]}"', f"-L{out}", f"-l{name}", f"-Wl,-rpath,{out}",
               "-lm", "-lpthread", "-o", str(binary)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return binary
