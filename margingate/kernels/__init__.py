"""Kernels whose numerics define the tokens. Bump VERSION whenever a change alters
any kernel's output bits: cached measurement runs are keyed by it."""
VERSION = 2  # 2: grouped-query decode attention (commit df3bd3d)
