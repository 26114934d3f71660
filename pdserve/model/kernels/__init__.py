"""Native CPU kernels (C, built on first use with the system compiler, loaded with ctypes)."""
