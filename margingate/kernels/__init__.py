"""Kernels whose numerics define the tokens: every Linear, norm, activation, rotary
embedding and attention of the model is computed here; the model only wires them.

- `library`: what PyTorch gives (oneDNN/MKL GEMMs, SDPA over a padded batch), batch-variant
  by nature: `fast-library` (the engine a user gets without our kernels) and LayerCast.
- `invariant`: our compiled kernels (`csrc/`, the orders stated once in `csrc/contract.h`),
  whose reduction orders are fixed by the row alone, at any batch, slot, thread count, call or
  x86 CPU; faster here than the library's, so `fast` runs them too and gets its batch variance
  from its attention, which aligns key chunks to the padded batch. `packing`: the weights'
  panel layout, packed once at load.
- `layers`: picks one of the two sets for a forward, and fixes the op order of the MLP and
  the head; `rotary`: the RoPE tables and rotation; `attention`: a forward's rows split
  into exact rows and batched (padded) decode rows.

Bump VERSION whenever a change alters any kernel's output bits: cached measurement runs
are keyed by it.
"""
# 3: compiled invariant kernels, rotary tables by position, fused qkv / gate-up
# 4: the bf16 linear reduces in vdpbf16ps's order (the instruction where it exists, else emulated)
# 5: `fast` on the compiled kernels, its batched attention chunks aligned to the padded batch
#    (exact rows, and so every deterministic policy's tokens, unchanged from 4)
# 6: the linear reduces in AMX's order (TDPBF16PS: even and odd FMA chains per 32-k block), run
#    natively on AMX and bit for bit on AVX-512 and AVX2; weights packed once at load
# 7: seeded sampling's uniforms from our own Philox4x32-10 keyed by (seed, position, token id), not
#    torch's mt19937; top_p's total in the kernels' fixed order (greedy tokens unchanged from 6)
# 8: a GGUF's quantized matrices under the integer-exact contract by default (--weights auto: int8
#    activations, exact integer sums, one fp32 epilogue: csrc/contract.h, 5); --weights exact keeps 7's bits
# 9: int8 K/V with an fp32 scale per 32 values, stored in the Hadamard basis (the query rotated alike, the output
#    rotated back: csrc/contract.h, 6); int4 K/V. A bf16 cache's bits, and so every digest, unchanged from 8
VERSION = 9
