"""Kernels whose numerics define the tokens: every Linear, norm, activation, rotary
embedding and attention of the model is computed here; the model only wires them.

- `library`: what PyTorch gives (oneDNN/MKL GEMMs, SDPA over a padded batch). Fast where
  the library is, and batch-variant: the `fast` path and the inverse control.
- `invariant`: our compiled kernels (`csrc/invariant.cpp`), whose reduction orders are
  fixed by the row alone, at any batch, slot, thread count or call.
- `layers`: picks one of the two sets for a forward, and fixes the op order of the MLP and
  the head; `rotary`: the RoPE tables and rotation; `attention`: a forward's rows split
  between the invariant attention and the library's padded batched call.

Bump VERSION whenever a change alters any kernel's output bits: cached measurement runs
are keyed by it.
"""
# 3: compiled invariant kernels, rotary tables by position, fused qkv / gate-up
# 4: the bf16 linear reduces in vdpbf16ps's order (the instruction where it exists, else emulated)
VERSION = 4
