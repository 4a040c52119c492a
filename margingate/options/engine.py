"""`EngineConfig`: how an engine is sized (requests, context, KV pool, threads, prefill chunks, prefix cache)."""
from __future__ import annotations

from dataclasses import dataclass

#: the prefix cache's size when a command turns it on (prefix_cache.py); SmolLM2-135M: ~23 KB of K/V per
#: position, ~370 MB in all
PREFIX_CACHE_TOKENS = 16384
STEP_GRAPHS = ("auto", "cuda", "stand-in", "off")
#: the KV cache's formats a user may name (kernels/kv_format.py: KV_FORMATS says how each is stored)
KV_CACHE_DTYPES = ("bfloat16", "int8", "int4")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 64        # requests running at once (one decode row each per step)
    max_model_len: int | None = None  # positions per request (prompt + output); None: the model's own context
    kv_cache_memory: float | None = None  # GB for the KV pool; None: engine/pool.py's default from free memory
    kv_block_size: int = 16       # positions per KV block
    kv_cache_dtype: str = "bfloat16"  # or int8, int4: each position's K and V rotated, quantized per 32 values
    num_threads: int | None = None  # torch CPU threads; None: all cores
    prefill_chunk: int | None = None  # prompt positions per request per step; None: as many as the budget allows
    # rows per step, decode rows first, then prompt chunks (a long prompt is prefilled over several steps)
    max_num_batched_tokens: int = 4096
    prefix_cache_tokens: int = 0      # prompt positions whose K/V are kept for reuse (prefix_cache.py); 0: off
    # speculative rows only where the step profile says they pay (step_profile.py); False: every
    # request feeds all the proposals it asks for (benchmarks; the tokens are the same either way)
    speculative_cost_model: bool = True
    # forwards of up to `graph_rows` rows recorded once per bucket of rows (engine/step_graphs.py): `auto`, CUDA
    # graphs on a GPU and none on CPU; `cuda`; `stand-in`, the same buckets run eagerly (tests); `off`
    step_graphs: str = "auto"
    graph_rows: int = 512

    def __post_init__(self):
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GB, got {self.kv_cache_memory}")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if self.step_graphs not in STEP_GRAPHS:
            raise ValueError(f"step_graphs must be one of {', '.join(STEP_GRAPHS)}, got {self.step_graphs!r}")
        if self.graph_rows < 1:
            raise ValueError(f"graph_rows must be >= 1, got {self.graph_rows}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
