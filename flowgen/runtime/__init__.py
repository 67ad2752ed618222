"""Compilers and launchers that turn generated CUDA C++ into running kernels (GPU or CPU emulator)."""
