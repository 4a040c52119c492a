"""The facade: load a model, build an engine, turn prompts into results."""
from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import libc
from .data.prompts import Prompt
from .engine import Request, Result
from .engine.detokenize import text_decoder
from .engine.draft import DraftModel, check_draft
from .engine.engine import Engine, EngineConfig
from .engine.events import StreamEvent
from .engine.logprobs import TokenLogprob
from .engine.structured import Grammars
from .environment import environment_record
from .kernels import invariant
from .models import build_model
from .models.loader import gguf_parts, load_config, load_state_dict, replacement_weights, resolve_model_dir
from .models.named import DEFAULT_MODEL
from .models.quantize import check_source, quantize_state
from .models.tokenizer import Tokenizer
from .options import DEFAULT_TAU, PolicySpec, SamplingParams, SpeculativeConfig
from .options.engine import engine_config
from .options.weights import QUANT_CONTRACT, check_weights
from .policies import Policy, build
from .profiles import load_profile
from .scoring import Score, score_pairs

PromptLike = Prompt | str | list[dict]
PromptsLike = PromptLike | list[PromptLike]


def as_prompts(prompts: PromptsLike) -> list[Prompt]:
    """One prompt or a list of them, each a `Prompt`, raw text or a chat's message list."""
    one = isinstance(prompts, (str, Prompt)) or (isinstance(prompts, list) and bool(prompts)
                                                 and all(isinstance(m, dict) for m in prompts))
    out = []
    for i, p in enumerate([prompts] if one else list(prompts)):
        if isinstance(p, str):
            p = Prompt("text", None, p, f"generate:{i}")
        elif isinstance(p, list) and p and all(isinstance(m, dict) and "role" in m and "content" in m for m in p):
            p = Prompt("chat", tuple(p), None, f"generate:{i}")
        if not isinstance(p, Prompt):
            raise TypeError(f"prompt {i}: expected a string, a message list or a Prompt, got {type(p).__name__}")
        out.append(p)
    return out


@dataclass
class Completion:
    prompt_index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None   # with SamplingParams(logprobs=k)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, device: str = "cpu", policy: str = "fast",
                 draft_model: str | None = None, kernels: str = "auto", weights: str = "auto",
                 quantize: str | None = None, **engine):
        """`engine`: the engine's knobs by name (max_num_seqs, max_model_len, num_threads, kv_cache_memory,
        kv_cache_dtype, kv_block_size, prefill_chunk, max_num_batched_tokens, prefix_cache_tokens, step_graphs,
        ...), each declared once with its default in options/engine.py's `EngineConfig`."""
        started = time.perf_counter()
        config = engine_config(engine)  # a bad knob fails before anything loads
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but no CUDA device is available")
        check_weights(weights, quantize)
        check_source(model, quantize)
        invariant.ops()  # build (or load) the invariant kernels now: a machine that cannot fails here, loudly
        # a GGUF read directly (weights "auto" or "exact") needs only its config and tokenizer converted
        self.folder = resolve_model_dir(model, tensors=weights == "bf16" or gguf_parts(model) is None)
        self.model_name = model
        self.quantize = quantize  # recorded: a folder quantized at load has other bits than the folder
        self.config = load_config(self.folder)
        self.tokenizer = Tokenizer(self.folder)
        state = self._state(model, weights, quantize)
        self.model = build_model(self.config, state, device, kernels)
        # where the packed matrices came from: the cache ("hit"), packed now ("miss"), or no cache (None)
        self.weights_cache = state.packed_cache.outcome if getattr(state, "packed_cache", None) else None
        self.profile = load_profile(self.config)
        self.default_tau = float(self.profile["tau"]) if self.profile else DEFAULT_TAU
        self.default_policy = self.policy(policy)
        self.grammars = Grammars(self.tokenizer, self.config.vocab_size)
        draft = self._load_draft(draft_model, config) if draft_model is not None else None
        self.engine = Engine(self.model, config, lambda: self.default_policy, draft=draft,
                             detokenize=text_decoder(self.tokenizer), grammars=self.grammars)
        self.load_seconds = time.perf_counter() - started  # this start: kernels, tokenizer, weights, engine

    def _state(self, model: str, weights: str, quantize: str | None):
        """The model's tensors. weights "auto": a GGUF's quantized matrices stay quantized, under the
        integer-exact contract (int8 activations, exact integer sums); "exact": they stay quantized and
        give the tokens and logprobs of "bf16" at the file's size; "bf16": every weight dequantized.
        quantize "q8_0" or "q4_k": a bf16 source's matrices quantized at load (models/quantize.py), the
        tokens and logprobs of its `margingate export --quantize` GGUF under the same --weights."""
        contract = QUANT_CONTRACT.get(weights)
        if quantize is not None:
            return quantize_state(load_state_dict(self.folder), self.config, quantize, contract=contract)
        gguf = gguf_parts(model) if contract else None
        return load_state_dict(self.folder, gguf=gguf, contract=contract or "int8")

    def update_weights(self, source: Mapping[str, torch.Tensor] | str | Path) -> int:
        """Replace the model's weights from the next request on: `source` is a state dict by transformers'
        names (`TrainableModel.state_dict()`, any dtype: held as bf16, as a load holds them) or a folder of
        safetensors. Checked whole against the model's config before anything changes (a missing, stray or
        misshapen tensor is refused by name); refused while requests are in flight. Returns the new weight
        version, which every result's report carries; cached prefixes are dropped."""
        self.engine.require_idle("update weights")  # before the weights are built: a refusal changes nothing
        version = self.engine.update_weights(replacement_weights(self.model, source))
        self.weights_cache = None  # no longer the file's packed matrices
        return version

    def weights_folder(self) -> Path:
        """The model's folder with its tensors (bf16 safetensors), converted from its GGUF if they are not
        there yet: what the peers (transformers, vLLM, a BF16 GGUF for llama.cpp) read."""
        return resolve_model_dir(self.model_name)

    def _load_draft(self, name: str, engine: EngineConfig) -> DraftModel:
        """A draft model for `speculative: draft`: same tokenizer, invariant kernels, its own KV cache (sized
        as the engine's: draft.py)."""
        folder = resolve_model_dir(name)
        config = load_config(folder)
        check_draft(self.config.vocab_size, config.vocab_size, self.tokenizer.same_vocabulary(Tokenizer(folder)))
        return DraftModel(build_model(config, load_state_dict(folder), self.device, self.model.kernels),
                          engine)

    def policy(self, spec: PolicySpec | str, **options) -> Policy:
        """A policy from a spec, or from a name and options (`llm.policy("margin", tau=0.3)`);
        margin's tau defaults to this model's calibrated profile; `auto` resolves for this device."""
        if isinstance(spec, str):
            spec = PolicySpec(spec, **options)
        elif options:
            spec = spec.replace(**options)
        return build(spec, self.default_tau, self.device)

    @property
    def device(self) -> str:
        return str(self.model.device)

    def requests(self, prompts: PromptsLike, *, max_new_tokens: int = 128, policy: Policy | None = None,
                 ignore_eos: bool = False, sampling: SamplingParams | None = None,
                 speculative: SpeculativeConfig | None = None) -> list[Request]:
        """One request per prompt; `sampling` (default: greedy) and `speculative` are every request's."""
        return [Request(self.tokenizer.encode_prompt(p), max_new_tokens, policy, ignore_eos=ignore_eos,
                        request_id=f"p{i}", sampling=sampling or SamplingParams(), speculative=speculative)
                for i, p in enumerate(as_prompts(prompts))]

    def generate(self, prompts: PromptsLike, *, progress: bool = False, **kw) -> list[Completion]:
        """Decode `prompts` together; keywords as `requests` (max_new_tokens, policy, sampling, ...).
        As vLLM's: a string is raw text (no chat template), a message list ([{"role", "content"}, ...])
        goes through the chat template; one prompt or a list of them, `Prompt`s too."""
        results = self.engine.generate(self.requests(prompts, **kw), progress=progress)
        self.release_memory()
        return [self.completion(i, r) for i, r in enumerate(results)]

    def score(self, prompt_ids: list[int], continuation_ids: list[int], *, top_logprobs: int = 0) -> Score:
        """The logprob of each continuation token after the prompt (and its top alternatives): bitwise
        what generating that continuation reported under a policy that guarantees logprobs."""
        return self.score_batch([(prompt_ids, continuation_ids)], top_logprobs=top_logprobs)[0]

    def score_batch(self, pairs: list[tuple[list[int], list[int]]], *, top_logprobs: int = 0,
                    progress: bool = False) -> list[Score]:
        """`score` for many (prompt, continuation) pairs, prefilled together."""
        scores = score_pairs(self.engine, pairs, top_logprobs, progress)
        self.release_memory()
        return scores

    @staticmethod
    def release_memory() -> int | None:
        """The engine is idle: give the C heap's free pages back, as the server does once idle (server/core/heap.py).
        A step's transient tensors are freed into glibc's heaps, which keep them (about 20 MB after a 1B's
        prefill); a trim costs about a millisecond. `generate` and `score_batch` call it as they return. The
        resident bytes released, or None without glibc."""
        return libc.trim()

    def stream(self, requests: list[Request]) -> Iterator[StreamEvent]:
        return self.engine.stream(requests)

    def completion(self, index: int, result: Result) -> Completion:
        """`result` as text: the engine's (detokenize.py), cut before a stop string."""
        return Completion(index, result.token_ids, result.text, result.finish_reason, result.stats, result.logprobs)

    def environment(self) -> dict:
        """What the determinism contract depends on besides the request: record it in every report."""
        return environment_record(self)
