"""`EngineConfig`: how an engine is sized (requests, context, KV pool, threads, prefill chunks, prefix cache).

Each knob is declared once, here, as vLLM's `EngineArgs` declares its own: a field with its type, its default and
a `Knob` (help, bounds, choices, command-line flag). From that one declaration `EngineConfig` validates itself,
`cli_args.add_engine_args` writes the flags, `cli_args.engine_options` reads them back, and `LLM(**engine)`
takes the same names as keywords (tests/test_engine_knobs.py holds the three to the declared defaults).
"""
from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any

#: the prefix cache's size when a command turns it on (prefix_cache.py); SmolLM2-135M: ~23 KB of K/V per
#: position, ~370 MB in all
PREFIX_CACHE_TOKENS = 16384
STEP_GRAPHS = ("auto", "cuda", "stand-in", "off")
#: the KV cache's formats a user may name (kernels/kv_format.py: KV_FORMATS says how each is stored)
KV_CACHE_DTYPES = ("bfloat16", "int8", "int4")
GRAPH_ROWS = 512


@dataclass(frozen=True, slots=True)
class Knob:
    """How one `EngineConfig` field shows outside the engine: what it means, the values allowed, its flag."""
    help: str
    minimum: float | None = None  # the least value allowed (None where the field's default is None: unset)
    above: bool = False           # `minimum` itself excluded (> rather than >=)
    unit: str = ""                # said after the bound in a refusal
    choices: tuple[str, ...] | None = None
    flag: str | None = None       # the command-line flag: None, "--" and the name's words; "": none of its own
    metavar: str | None = None

    def check(self, name: str, value: Any, optional: bool) -> None:
        """Refuses `value` naming the field: below its bound or not one of its choices (None where `optional`)."""
        if value is None and optional:
            return
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.minimum is not None and (value <= self.minimum if self.above else value < self.minimum):
            bound = f"{'>' if self.above else '>='} {self.minimum:g}{' ' + self.unit if self.unit else ''}"
            raise ValueError(f"{name} must be {bound}, got {value}")


def knob(default: Any, help: str, **how) -> Any:
    """A field of `EngineConfig`: its default and its `Knob`."""
    return field(default=default, metadata={"knob": Knob(help, **how)})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = knob(64, "requests running at once (one decode row each per step)", minimum=1)
    max_model_len: int | None = knob(
        None, "positions per request (prompt + output; default: the model's own context, within the KV pool)",
        minimum=2)
    kv_cache_memory: float | None = knob(
        None, "the KV pool's size (default: 40% of the memory available at start, at most what --max-num-seqs "
              "full-context requests need); pages become resident as blocks are used",
        minimum=0, above=True, unit="GB", metavar="GB")
    kv_block_size: int = knob(16, "positions per KV block", minimum=1, metavar="N")
    kv_cache_dtype: str = knob(
        "bfloat16", "int8, int4: each position's K and V rotated (Hadamard) and quantized by themselves, an fp32 "
                    "scale per 32 values (int8: 0.56x the bytes of bf16, int4: 0.31x)",
        choices=KV_CACHE_DTYPES)
    num_threads: int | None = knob(None, "torch CPU threads (default: all cores; the tokens do not depend on it)",
                                   minimum=1, flag="--threads")
    prefill_chunk: int | None = knob(
        None, "prompt positions per request per step, sharing steps with decode rows (default: as many as "
              "--max-num-batched-tokens leaves)", minimum=1, metavar="N")
    # rows per step, decode rows first, then prompt chunks (a long prompt is prefilled over several steps)
    max_num_batched_tokens: int = knob(
        4096, "rows per step: every decode row, then prompt chunks, oldest request first", minimum=1, metavar="N")
    # the command line's switch is `--no-prefix-cache` (cli_args.add_prefix_cache_arg: on, PREFIX_CACHE_TOKENS)
    prefix_cache_tokens: int = knob(
        0, "prompt positions whose K/V are kept for reuse (prefix_cache.py); 0: off", minimum=0, flag="")
    speculative_cost_model: bool = knob(
        True, "speculative rows only where the step profile says they pay (step_profile.py); False: every "
              "request feeds all the proposals it asks for (benchmarks; the tokens are the same either way)", flag="")
    step_graphs: str = knob(
        "auto", f"forwards of up to {GRAPH_ROWS} rows padded to buckets and recorded once each "
                "(engine/step_graphs.py): auto (CUDA graphs on a GPU, none on CPU), cuda, stand-in (the same "
                "buckets run eagerly), off", choices=STEP_GRAPHS)
    graph_rows: int = knob(GRAPH_ROWS, "the most rows a recorded forward holds", minimum=1, flag="")

    def __post_init__(self):
        for f in fields(self):
            f.metadata["knob"].check(f.name, getattr(self, f.name), optional=f.default is None)


def engine_knobs() -> dict[str, tuple[Field, Knob]]:
    """{name: (its dataclass field: type and default, its `Knob`)} for every engine knob, in declaration order."""
    return {f.name: (f, f.metadata["knob"]) for f in fields(EngineConfig)}


def knob_type(f: Field) -> type:
    """A knob's value type (int, float, str or bool), read from its annotation ("int | None" -> int)."""
    names = {"int": int, "float": float, "str": str, "bool": bool}
    return next(names[part.strip()] for part in str(f.type).split("|") if part.strip() in names)


def engine_config(engine: dict[str, Any]) -> EngineConfig:
    """`EngineConfig(**engine)`, an unknown name refused with the names there are (`LLM`'s keywords)."""
    unknown = sorted(set(engine) - set(engine_knobs()))
    if unknown:
        raise TypeError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the engine's "
                        f"are {', '.join(engine_knobs())}")
    return EngineConfig(**engine)
