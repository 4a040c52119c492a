"""Command-line pieces every subcommand shares: argument types, the model and policy options,
and turning parsed arguments into prompts, an `LLM` and a `PolicySpec`."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from .data.prompts import Prompt, builtin_prompts, load_prompts_file
from .models.named import DEFAULT_MODEL, NAMED
from .options import (
    DEFAULT_DEFER,
    DEFAULT_GROUP,
    DEFAULT_WINDOW,
    MAX_SPECULATIVE_TOKENS,
    METHODS,
    POLICY_NAMES,
    PRECISIONS,
    REPAIRS,
    PolicySpec,
    SamplingParams,
    SpeculativeConfig,
    SpeculativeError,
    parse_tau,
)
from .options.engine import KV_CACHE_DTYPES, PREFIX_CACHE_TOKENS, STEP_GRAPHS
from .options.weights import QUANTIZE, WEIGHTS

# --- argument types: each names the problem in its message -------------------------------


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


positive_int, non_negative_int = int_at_least(1), int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers: "4,16"."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def int_list_or_none(text: str) -> list[int]:
    """Like int_list; "none" (or nothing) is the empty list."""
    return [] if text.strip().lower() in ("none", "") else int_list(text)


def tau(text: str) -> float:
    try:
        return parse_tau(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --- shared options ----------------------------------------------------------------------


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a named model ({', '.join(NAMED)}), a .gguf file (a split one's first part) or a "
                        f"local Hugging Face folder (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--kernels", default="auto", choices=("auto", "compiled", "triton"),
                   help="the invariant kernels: auto (Triton on CUDA, compiled C++ on CPU), compiled, or triton "
                        "(on CPU: the CUDA path under Triton's interpreter, TRITON_INTERPRET=1; slow, for dry runs)")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="auto: a GGUF's quantized matrices (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) stay "
                        "quantized, run with int8 activations and exact integer sums (one float order on every "
                        "CPU); exact: kept quantized, the tokens and logprobs of bf16 at the file's size; "
                        "bf16: dequantize all")
    add_quantize_arg(p, "at load, as `margingate export --quantize` writes them: the same tokens and logprobs")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: all cores; the tokens do not depend on it)")
    p.add_argument("--max-model-len", type=int_at_least(2), default=None,
                   help="positions per request (prompt + output; default: the model's own context, within the KV pool)")
    p.add_argument("--kv-cache-memory", type=positive_float, default=None, metavar="GB",
                   help="the KV pool's size (default: 40%% of the memory available at start, at most what "
                        "--max-num-seqs full-context requests need); pages become resident as blocks are used")
    p.add_argument("--kv-cache-dtype", default="bfloat16", choices=KV_CACHE_DTYPES,
                   help="int8, int4: each position's K and V rotated (Hadamard) and quantized by themselves, an fp32 "
                        "scale per 32 values (int8: 0.56x the bytes of bf16, int4: 0.31x)")
    p.add_argument("--kv-block-size", type=positive_int, default=16, metavar="N", help="positions per KV block")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                   help="prompt positions per request per step, sharing steps with decode rows (default: as many "
                        "as --max-num-batched-tokens leaves)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=4096, metavar="N",
                   help="rows per step: every decode row, then prompt chunks, oldest request first")
    p.add_argument("--step-graphs", default="auto", choices=STEP_GRAPHS,
                   help="forwards of up to 512 rows padded to buckets and recorded once each: auto (CUDA graphs on "
                        "a GPU, none on CPU), cuda, stand-in (the same buckets run eagerly), off")


def add_quantize_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--quantize", default=None, choices=QUANTIZE,
                   help=f"quantize a bf16 source (a Hugging Face folder) to GGUF blocks {what}: q4_k (Q4_K; Q8_0 "
                        "for a matrix whose rows are not a multiple of 256 weights) or q8_0")


def add_prefix_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill every prompt in full (default: reuse the K/V of cached prompt prefixes, "
                        f"up to {PREFIX_CACHE_TOKENS} positions; the tokens are bitwise the same)")


def add_policy_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--policy", default=default, choices=POLICY_NAMES,
                   help="auto: the cheapest guaranteed policy for --device (CPU: batch-invariant; CUDA: the one "
                        "that GPU's bench measured cheaper, batch-invariant or margin)")
    p.add_argument("--tau", type=tau, default=None,
                   help="margin threshold in logits; inf verifies every step (default: the model profile's)")
    p.add_argument("--repair", default="replay", choices=REPAIRS)
    p.add_argument("--verifier-precision", default="bf16", choices=PRECISIONS)
    p.add_argument("--no-strict", action="store_true", help="margin/replay: never roll back emitted tokens")
    p.add_argument("--defer", type=non_negative_int, default=DEFAULT_DEFER,
                   help="margin/replay: steps a flagged token may wait for a shared verifier pass (0: at once)")
    p.add_argument("--window", type=positive_int, default=DEFAULT_WINDOW, help="dvr: tokens per verified window")
    p.add_argument("--group", type=positive_int, default=DEFAULT_GROUP,
                   help="dvr: requests per fixed-shape verifier pass")
    p.add_argument("--inject-flip-at", type=non_negative_int, default=None, metavar="K",
                   help="testing: emit a wrong token at output index K to exercise rollback")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The request's sampling options (SamplingParams validates them when the command runs)."""
    g = p.add_argument_group("sampling (applied per request, from its own history; see engine/sampling.py)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: seeded Gumbel-max")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one, reported)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--logprobs", type=non_negative_int, default=None, metavar="K",
                   help="report each token's logprob and its K best alternatives (in --json output)")
    g.add_argument("--logprobs-mode", choices=("raw", "processed"), default=None,
                   help="the model's distribution, or the one sampled from (default: processed when constrained)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="a stop string (repeatable)")
    c = p.add_argument_group("structured output (one of; engine/structured.py)")
    c.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema, or @FILE holding one")
    c.add_argument("--json-object", action="store_true", help="any JSON object")
    c.add_argument("--regex", help="a regular expression the whole output matches")
    c.add_argument("--choice", action="append", default=None, metavar="TEXT", help="one allowed output (repeatable)")
    c.add_argument("--grammar", metavar="GRAMMAR", help="a Lark or GBNF grammar, or @FILE holding one")


def _text_or_file(text: str | None) -> str | None:
    if text is None or not text.startswith("@"):
        return text
    with open(text[1:], encoding="utf-8") as f:
        return f.read()


def structured_output(args):
    """The constraint the flags give (None: none), validated; a bad one exits naming its flag."""
    from .options.structured import StructuredError, StructuredOutput

    options = {"json": _text_or_file(args.json_schema), "json_object": args.json_object, "regex": args.regex,
               "choice": args.choice, "grammar": _text_or_file(args.grammar)}
    options = {k: v for k, v in options.items() if v not in (None, False)}
    if not options:
        return None
    try:
        return StructuredOutput(**options)
    except StructuredError as exc:
        raise SystemExit(f"{_flag(exc.option)}: {exc}") from None


def _flag(option: str) -> str:
    return "--json-schema" if option == "json" else "--" + option.replace("_", "-")


def compile_or_exit(llm, constraint) -> None:
    """A schema, regex or grammar the engine cannot compile exits naming its flag, before any decoding."""
    from .options.structured import StructuredError

    try:
        llm.grammars.compile(constraint)
    except StructuredError as exc:
        raise SystemExit(f"{_flag(exc.option)}: {exc}") from None


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (proposals checked by the invariant kernels: the same "
                             "tokens under batch-invariant; see engine/speculative.py)")
    g.add_argument("--speculative", choices=METHODS, default=None, help="propose tokens with this method")
    g.add_argument("--num-speculative-tokens", type=positive_int, default=4, metavar="K",
                   help=f"proposals per step (1..{MAX_SPECULATIVE_TOKENS})")
    add_draft_model_arg(g)


def add_draft_model_arg(p) -> None:
    p.add_argument("--draft-model", default=None,
                   help="load a draft model for `--speculative draft` (same tokenizer; a named model or a folder)")


def speculative_config(args):
    """The request's speculation (None: off), validated by `SpeculativeConfig`; a bad value exits naming
    its flag."""
    if args.speculative is None:
        return None
    try:
        return SpeculativeConfig(args.speculative, args.num_speculative_tokens)
    except SpeculativeError as exc:
        flag = {"method": "--speculative", "num_tokens": "--num-speculative-tokens"}.get(exc.option, exc.option)
        raise SystemExit(f"{flag}: {exc}") from None


def sampling_params(args):
    return SamplingParams(temperature=args.temperature, seed=args.seed, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          logprobs=args.logprobs, logprobs_mode=args.logprobs_mode, stop=tuple(args.stop or ()),
                          structured=structured_output(args))


def add_prompt_args(p: argparse.ArgumentParser, limit: int | None, what: str = "use only the first N prompts") -> None:
    p.add_argument("--prompts-file", help="JSON lines: {prompt|messages|text: ...} (default: the built-in prompts)")
    p.add_argument("--limit", type=non_negative_int, default=limit, help=f"{what} (0: all)")


# --- from arguments to objects -----------------------------------------------------------


def policy_spec(args) -> PolicySpec:
    """The policy asked for, `auto` resolved for --device."""
    return PolicySpec(args.policy, tau=args.tau, repair=args.repair, verifier_precision=args.verifier_precision,
                      strict=not args.no_strict, defer=args.defer, window=args.window, group=args.group,
                      inject_flip_at=args.inject_flip_at).resolve(args.device)


def prompts(args) -> list[Prompt]:
    out = [Prompt("chat", ({"role": "user", "content": t},), None, f"argv:{i}")
           for i, t in enumerate(getattr(args, "prompt", None) or [])]
    if args.prompts_file:
        out += load_prompts_file(args.prompts_file)
    limit = getattr(args, "limit", None)
    if not out:
        out = builtin_prompts()
        if limit and limit < len(out):  # spread over the categories, not the first N (all math)
            return [out[i * len(out) // limit] for i in range(limit)]
    return out[:limit] if limit else out


def llm(args, max_num_seqs: int):
    from .llm import LLM  # loads torch and the kernels: only when a command runs

    return LLM(args.model, device=args.device, kernels=args.kernels, weights=args.weights, quantize=args.quantize,
               max_num_seqs=max_num_seqs,
               draft_model=getattr(args, "draft_model", None),
               max_model_len=args.max_model_len, num_threads=args.threads, prefill_chunk=args.prefill_chunk,
               prefix_cache_tokens=PREFIX_CACHE_TOKENS if getattr(args, "prefix_cache", False) else 0,
               kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
               kv_block_size=args.kv_block_size, max_num_batched_tokens=args.max_num_batched_tokens,
               step_graphs=args.step_graphs)
