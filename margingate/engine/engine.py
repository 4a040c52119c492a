"""The engine loop: admit -> prefill -> one batched decode step -> policies -> stream out."""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from ..models.decoder import DecoderModel
from ..options.engine import EngineConfig
from .detokenize import Detokenizer
from .events import Load, PhaseTotals, StreamEvent
from .logprobs import logprobs_of
from .policy import Policy, VerifyJob
from .pool import build_pool, context_length, requested_context
from .prefix_cache import PrefixCache
from .proposers import SpeculationStats, proposer_for
from .runner import Runner
from .sampling import RowChoices, choose
from .scheduler import Scheduler
from .sequence import Request, Result, Sequence
from .speculative import accept, off_reason, propose
from .step_profile import StepProfile
from .verifier import Verifier

PHASES = ("prefill", "decode", "verify")


class Engine:
    def __init__(self, model: DecoderModel, config: EngineConfig, default_policy: Callable[[], Policy], *,
                 draft=None, detokenize=None, grammars=None):
        self.model, self.config = model, config
        self.num_threads = config.num_threads or os.cpu_count() or 1
        torch.set_num_threads(self.num_threads)  # part of the determinism contract: recorded in reports
        self.kv = build_pool(model, config)
        self.max_len = context_length(model.config, config, self.kv)
        graphs = config.step_graphs
        if graphs == "auto":
            graphs = "cuda" if model.device.type == "cuda" else "off"
        self.runner = Runner(model, self.kv, graphs=graphs, max_len=self.max_len,
                             graph_rows=max(config.graph_rows, config.max_num_seqs))
        self.verifier = Verifier(self.runner)
        self.draft = draft  # a DraftModel (draft.py) for `speculative: draft` requests
        # token ids -> text (detokenize.text_decoder), for each request's text and stop strings (None: no text).
        # Called on the engine's thread only.
        self.detokenize = detokenize
        self.grammars = grammars    # structured output's compiler (structured.Grammars; None: no constraints)
        self.prefix = PrefixCache(self.kv, config.prefix_cache_tokens) if config.prefix_cache_tokens else None
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.prefix, self.max_len)
        self.default_policy = default_policy
        self.step_count = 0
        self.weight_version = 0  # how many times the weights were replaced since load (`update_weights`)
        self.totals = {phase: PhaseTotals() for phase in PHASES}
        self.step_profile = StepProfile()  # the decode forward's cost by rows: when a proposal pays
        self._finished: list[Sequence] = []
        self._aborted: list[Sequence] = []

    @property
    def load(self) -> Load:
        s, free = self.scheduler, self.kv.num_free
        cached = self.prefix.evictable if self.prefix is not None else 0
        used = self.kv.num_blocks - free - cached - 1  # the runner's sink block
        return Load(len(s.waiting), len(s.running), used, free, cached, s.preemptions)

    def release_idle_memory(self) -> int:
        """Idle: the KV pool's free blocks give their pages back (models/kv_cache.py); the bytes released."""
        return self.kv.release_free_pages()

    def update_weights(self, weights, keep: bool = False) -> int:
        """Run `weights` (models.weights.ModelWeights, built for this model's config) from the next step on;
        refused while requests are in flight (the server pauses first), unless `keep`: then each running request
        is preempted, so it recomputes its K/V under the new weights (its tokens so far kept) and none runs on
        K/V of both. Cached prefixes and recorded forwards are dropped; the new weight version, which every
        result reports."""
        if keep:
            for seq in reversed(list(self.scheduler.running)):  # newest first: the oldest ends at the queue's front
                self.scheduler.preempt(seq)
        else:
            self.require_idle("update weights")
        self.model.replace_weights(weights)
        self.runner.weights_changed()
        self.reset_prefix_cache()
        self.weight_version += 1
        return self.weight_version

    def require_idle(self, what: str) -> None:
        """RuntimeError naming the requests in flight, if any: `what` waits for them to finish or be aborted."""
        if self.has_work:
            raise RuntimeError(f"cannot {what} with {len(self.scheduler.running)} running and "
                               f"{len(self.scheduler.waiting)} waiting requests: finish, abort or pause them first")

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix; the blocks dropped (0 without a prefix cache)."""
        return self.prefix.clear() if self.prefix is not None else 0

    def running_ids(self) -> list[str]:
        return [seq.request_id for seq in self.scheduler.running]

    # --- requests ----------------------------------------------------------------
    def add_request(self, request: Request) -> Sequence:
        if any(s.request_id == request.request_id for s in [*self.scheduler.running, *self.scheduler.waiting]):
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if len(request.prompt_ids) + 1 > self.max_len:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens is longer than the context "
                             f"({self.max_len} positions{self._context_limit()}, room for at least one new token "
                             f"needed)")
        if max(request.prompt_ids) >= self.model.config.vocab_size or min(request.prompt_ids) < 0:
            raise ValueError("prompt token id out of the vocabulary range")
        request.sampling.check_vocab(self.model.config.vocab_size)
        stop = request.stop_token_ids if request.stop_token_ids is not None else self.model.config.eos_token_ids
        seq = Sequence(request, request.policy or self.default_policy(), frozenset(stop))
        seq.state = seq.policy.new_state(seq)
        if self.detokenize is not None:
            seq.detokenizer = Detokenizer(self.detokenize, request.sampling.stop)
        elif request.sampling.stop:
            raise ValueError("stop strings need a detokenizer: this engine was built without a tokenizer")
        if request.sampling.structured is not None:
            if self.grammars is None:
                raise ValueError("structured output needs a tokenizer: this engine was built without one")
            seq.grammar = self.grammars.matcher(request.sampling.structured)  # a bad one: StructuredError
        if request.speculative is not None:
            request.speculative.check(self.draft)
            seq.speculation = SpeculationStats(off=off_reason(seq.policy, seq.grammar is not None))
        if request.share_prefill is not None and request.sampling.prompt_logprobs is None:
            seq.fork_of = next((s for s in [*self.scheduler.running, *self.scheduler.waiting]
                                if s.request_id == request.share_prefill
                                and s.request.prompt_ids == request.prompt_ids), None)
        self.scheduler.add(seq)
        return seq

    def _context_limit(self) -> str:
        """What bounds the context, where it is the KV pool rather than the model or --max-model-len."""
        if self.max_len < requested_context(self.model.config, self.config):
            return f": all the KV pool holds ({self.kv.num_blocks} blocks; raise --kv-cache-memory)"
        return ""

    def abort(self, request_id: str) -> bool:
        """Drop a request now (a client went away): frees its blocks at once."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request_id == request_id:
                self._retire(seq)
                seq.finish_reason = "aborted"
                self._aborted.append(seq)  # reported as finished by the next step
                return True
        return False

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- the loop ------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Admit; one forward with every prompt chunk due and one decode row per running request;
        the policies; returns the requests that finished."""
        if torch.get_num_threads() != self.num_threads:  # another engine in this process changed it
            torch.set_num_threads(self.num_threads)
        self._finished, self._aborted = self._aborted, []
        for seq in self.scheduler.admit():
            self._start(seq)
        try:
            prefills, batch = self.scheduler.plan(self.config.max_num_batched_tokens, self.config.prefill_chunk)
            rows = self._speculate(batch)
            prefills, batch = self.scheduler.reserve_step(prefills, batch)
            if not prefills and not batch:
                self.step_count += 1
                return self._finished
            t = time.perf_counter()
            out = self.runner.step(prefills, batch)
            seconds = self._count("decode" if batch else "prefill", t, rows=len(batch))
            if batch and not prefills:
                self.step_profile.observe(rows, seconds)
            self.totals["prefill"].rows += sum(b - a for _, a, b in prefills)
            started = self._prefilled(prefills, out[:len(prefills)])
            if batch:
                self._decode(batch, out[len(prefills):])
        finally:
            for seq in self.scheduler.running:  # proposals are never the sequence's: a step that fails leaves none
                seq.drafts = []
        self._stop_finished([s for s in [*started, *batch] if s.should_stop(self.max_len)])
        for seq in self.scheduler.running:  # rolled back, or proposals rejected: the blocks past the end go back
            seq.cache.truncate(seq.num_tokens)
        self.step_count += 1
        return self._finished

    def _start(self, seq: Sequence) -> None:
        """A request just got its blocks: start its prompt where a sibling's or a cached prefix ends."""
        if seq.fork_of is not None:  # one of n samples: the sibling's prompt blocks, all but the last row
            seq.prefilled = seq.cached_tokens = seq.fork_of.prompt_len - 1
            seq.cache.share(seq.fork_of.cache, seq.prefilled)
            seq.fork_of = None
        elif self.prefix is not None and (seq.recompute or seq.request.sampling.prompt_logprobs is None):
            # after a preemption, its output too: the blocks it left behind (scheduler._keep_computed)
            hit = self.prefix.load(seq.tokens(0, seq.num_tokens), seq.cache)
            seq.prefilled = hit
            if not seq.recompute:
                seq.cached_tokens = hit
            elif not seq.prefilling:  # every position but the last token's was still cached: decode on
                seq.recompute = False

    def _prefilled(self, prefills: list[tuple[Sequence, int, int]], out: list) -> list[Sequence]:
        """After the forward: prompt logprobs, and the first token of each prompt now complete."""
        started = []
        for (seq, start, end), rows in zip(prefills, out):
            seq.prefilled = end
            if seq.recompute:  # a preempted request's K/V are back: it decodes on from its last token
                seq.recompute = seq.prefilling
                continue
            k = seq.request.sampling.prompt_logprobs
            if k is not None:  # row i chooses position start + i + 1; the prompt's first token has none
                n = min(end, seq.prompt_len - 1) - start
                seq.prompt_logprobs += [None] * (start == 0) + logprobs_of(rows[:n], seq.tokens(start + 1,
                                                                                         start + 1 + n), k)
            if end < seq.prompt_len:
                continue
            if seq.request.max_new_tokens:  # the prompt's last row chooses the first token
                choice = choose(seq, rows[-1:], seq.last_fed_pos)
                seq.output_ids.append(choice.tokens[0])
                self._record(seq, choice)
                seq.appended()
            if self.prefix is not None:  # the prompt path's K/V, before any decode write
                self.prefix.store(seq.request.prompt_ids, seq.cache)
            started.append(seq)
        return started

    def _speculate(self, batch: list[Sequence]) -> int:
        """Proposals for the requests that speculate, as many as pay (`step_profile.py`); the step's decode
        rows, proposals included."""
        rows = len(batch)
        for seq in batch:
            stats = seq.speculation
            if stats is None or stats.off:
                continue
            room = min(seq.request.max_new_tokens - len(seq.output_ids), self.max_len - seq.num_tokens) - 1
            k = min(seq.request.speculative.num_tokens, room)
            if k >= 1 and self.config.speculative_cost_model:
                k = self.step_profile.worth(stats.rate, rows, k, stats.seconds_per_proposal)
                stats.held += k == 0
            if k >= 1:
                if seq.proposer is None:  # on its first step: a draft proposer holds KV blocks of the draft
                    seq.proposer = proposer_for(seq.request.speculative, self.draft)
                rows += propose(seq, k)
        return rows

    def _decode(self, batch: list[Sequence], out: list[torch.Tensor]) -> None:
        """Each running request's decode rows: a speculating one accepts its proposals; for the
        others the policies propose, verify, commit."""
        plain = []
        for seq, rows in zip(batch, out):
            if seq.drafts:
                seq.steps += 1
                self._record(seq, accept(seq, rows))
                seq.appended()  # the step may have accepted tokens past a stop string
            else:
                plain.append((seq, rows[-1:]))
        if plain:
            self._policies_decode(*map(list, zip(*plain)))

    def _policies_decode(self, batch: list[Sequence], rows: list[torch.Tensor]) -> None:
        steps = [choose(s, row, s.last_fed_pos) for s, row in zip(batch, rows)]
        jobs = [seq.policy.propose(seq, step) for seq, step in zip(batch, steps)]
        if any(jobs):  # a pass runs this step: its fixed cost is paid, others may ride along
            jobs = [job or seq.policy.join(seq, step) for seq, step, job in zip(batch, steps, jobs)]
        verified = self._verify([j for j in jobs if j is not None])
        for seq, step, job in zip(batch, steps, jobs):
            seq.steps += 1
            rows_of = verified.get(id(job))
            seq.policy.commit(seq, step, rows_of)
            if rows_of is not None:  # the verifier's rows replace the fast ones they recomputed
                self._record(seq, rows_of)
            if len(seq.logprobs) < len(seq.output_ids):
                self._record(seq, step)
            seq.appended()

    def _record(self, seq: Sequence, choice: RowChoices) -> None:
        """Logprobs, from `choice`'s raw rows, of the output tokens they chose that the output still holds."""
        k, chosen = seq.request.sampling.logprobs, choice.positions
        lo, hi = max(chosen.start, seq.prompt_len), min(chosen.stop, seq.num_tokens)
        if k is None or lo >= hi:
            return
        rows = choice.processed if seq.request.sampling.processed_logprobs else choice.logits
        entries = logprobs_of(rows[lo - chosen.start:hi - chosen.start], seq.tokens(lo, hi), k)
        at = lo - seq.prompt_len
        seq.logprobs[at:at + len(entries)] = entries

    def _verify(self, jobs: list[VerifyJob]) -> dict[int, RowChoices]:
        """Each job's rows, keyed by id(job): one verifier pass (or one per precision / group)."""
        if not jobs:
            return {}
        t = time.perf_counter()
        out = self.verifier.run(jobs)
        self._count("verify", t, rows=sum(j.rows for j in jobs))
        return out

    def _stop_finished(self, stopping: list[Sequence]) -> None:
        # A strict policy may re-check the tail and roll back; loop until every request settles.
        while stopping:
            jobs = {id(s): s.policy.finish_job(s) for s in stopping}
            verified = self._verify([j for j in jobs.values() if j is not None])
            still = []
            for seq in stopping:
                job = jobs[id(seq)]
                confirmed = job is None or seq.policy.confirm_finish(seq, verified[id(job)])
                if job is not None:
                    self._record(seq, verified[id(job)])
                if confirmed:
                    seq.finish_reason = seq.should_stop(self.max_len) or "stop"
                    self._retire(seq)
                    self._finished.append(seq)
                else:
                    seq.appended()  # the re-check rolled back and appended the verifier's token
                    if seq.should_stop(self.max_len):
                        still.append(seq)
            stopping = still

    def _retire(self, seq: Sequence) -> None:
        """The request leaves the engine: its KV blocks, and its proposer's, are free."""
        self.scheduler.remove(seq)
        if seq.proposer is not None:
            seq.proposer.close()
            seq.proposer = None

    def _count(self, phase: str, t0: float, rows: int) -> float:
        """Add a forward since `t0` to the phase's totals; its seconds."""
        totals, seconds = self.totals[phase], time.perf_counter() - t0
        totals.calls += 1
        totals.rows += rows
        totals.seconds += seconds
        return seconds

    # --- drivers -------------------------------------------------------------------
    def result(self, seq: Sequence) -> Result:
        sp = seq.request.sampling
        stats = {**seq.policy.report(seq), "weight_version": self.weight_version}
        if seq.speculation is not None:  # exact under a deterministic policy; fast promises nothing
            stats.update(seq.speculation.report(), speculation_exact=seq.policy.deterministic)
        if seq.grammar is not None and seq.grammar.error is not None:
            stats["structured_output_error"] = seq.grammar.error
        return Result(seq.request_id, list(seq.request.prompt_ids), list(seq.output_ids),
                      seq.finish_reason or "aborted", stats, seq.cached_tokens,
                      list(seq.logprobs) if sp.logprobs is not None else None,
                      list(seq.prompt_logprobs) if sp.prompt_logprobs is not None else None,
                      seq.detokenizer.final_text() if seq.detokenizer is not None else None)

    def release(self, seq: Sequence, finished: bool) -> StreamEvent | None:
        """What `seq` hands its caller since the last call: the tokens its policy lets go (all of them
        once finished) with their logprobs, the prompt's logprobs once prefilled; None if nothing.
        The one release loop: `stream` and the server's worker both call it after each step."""
        prompt = None
        if not seq.prompt_released and seq.prefilled >= seq.prompt_len:
            seq.prompt_released = True
            prompt = list(seq.prompt_logprobs) if seq.request.sampling.prompt_logprobs is not None else None
        start = seq.released
        n = len(seq.output_ids) if finished else seq.policy.releasable(seq)
        new = seq.output_ids[start:n]
        seq.released = max(start, n)
        if not new and not finished and prompt is None:
            return None
        lps = seq.logprobs[start:start + len(new)] if seq.request.sampling.logprobs is not None else None
        event = StreamEvent(seq.request_id, new, finished, self.result(seq) if finished else None, lps, prompt)
        if seq.detokenizer is not None:
            event.text = seq.detokenizer.release(start + len(new), finished)
            event.text_offsets = seq.detokenizer.offsets(start, start + len(new))
        return event

    def stream(self, requests: list[Request], progress: bool = False) -> Iterator[StreamEvent]:
        """Run requests to completion, yielding tokens as their policies release them.

        A request joins at engine step `arrival_step` (relative to this call), so
        staggered arrivals replay exactly.
        """
        pending = sorted(requests, key=lambda r: r.arrival_step)
        start, live = self.step_count, []
        bar = tqdm(total=len(requests), desc="requests", disable=not progress, leave=False)
        while pending or self.has_work:
            while pending and pending[0].arrival_step <= self.step_count - start:
                live.append(self.add_request(pending.pop(0)))
            finished = self.step()
            for seq in live:
                event = self.release(seq, seq in finished)
                if event is not None:
                    yield event
            live = [s for s in live if s not in finished]
            bar.update(len(finished))
        bar.close()

    def generate(self, requests: list[Request], progress: bool = False) -> list[Result]:
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique within one generate call")
        results = {e.request_id: e.result for e in self.stream(requests, progress) if e.finished}
        return [results[r.request_id] for r in requests]
