"""The load test's figures (load_test.py): percentiles, one scenario's summary, the markdown report."""
from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 3)


def summarize(results: list[dict], wall: float, delta: dict[str, float]) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["done"]]
    tokens = sum(len(r["ids"]) for r in ok)
    batch_n = delta.get("margingate_batch_size_count", 0.0)
    return {
        "requests": len(results), "completed": len(ok),
        "status_5xx": sum(1 for r in results if (r["status"] or 0) >= 500 or (r["error"] or "").startswith("5")),
        "errors": sum(1 for r in results if r["status"] != 200 or not r["done"] or r["error"]),
        "wall_s": round(wall, 2), "throughput_req_s": round(len(ok) / wall, 2),
        "throughput_tok_s": round(tokens / wall, 1),
        "latency_p50_s": percentile([r["latency"] for r in ok], 0.5),
        "latency_p99_s": percentile([r["latency"] for r in ok], 0.99),
        "ttft_p50_s": percentile([r["ttft"] for r in ok if r["ttft"] is not None], 0.5),
        "ttft_p99_s": percentile([r["ttft"] for r in ok if r["ttft"] is not None], 0.99),
        "mean_batch_size": round(delta.get("margingate_batch_size_sum", 0.0) / batch_n, 2) if batch_n else None,
        "prefix_cache_hits": int(delta.get("margingate_prefix_cache_hits_total", 0)),
        "prefix_cache_reused_tokens": int(delta.get("margingate_prefix_cache_reused_tokens_total", 0)),
    }


def markdown(report: dict) -> str:
    cfg, env = report["config"], report["environment"]
    lines = [
        "# Load test: `margingate serve` on loopback",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        f"Machine: {report['host']['cpu']}, {report['host']['cpus']} cores; the server at its default threads "
        f"({env.get('num_threads')} torch threads = all cores), torch {env.get('torch')}, kernels "
        f"v{env.get('kernels_version')}, model `{env.get('model')}`. Max batch {cfg['max_num_seqs']}, queue "
        f"{cfg['max_queue']}, prefix cache on. `\"deterministic\": true` is `auto` = "
        f"`{report['auto_resolves_to']}` here. Requests stream (SSE), {cfg['max_tokens']} tokens each "
        f"(ignore_eos, greedy); latency: request sent to `[DONE]`; TTFT: to the first token released. "
        f"Measured {report['date']} (1-minute load average {report['load_avg_1m']:.1f} at the end): compare rows of "
        "one run.",
        "",
        "## Traffic mixes",
        "",
        f"{cfg['requests']} requests per row from {cfg['concurrency']} concurrent clients; request i takes built-in "
        "prompt i mod 40 in every row; a hit is any cached block (the chat template's default system prompt is one), "
        "and after the first row whole prompts repeat. "
        "On this CPU the deterministic rows are not slower: `auto` runs the invariant kernels, which are as fast "
        "as `fast`'s here (README, `auto`). \"Equal to alone\": each guaranteed response against the same request "
        "sent afterwards on the idle server.",
        "",
        "| deterministic | completed | 5xx | errors | wall s | req/s | tok/s | p50 latency s | p99 latency s "
        "| p50 TTFT s | p99 TTFT s | mean batch | prefix hits | equal to alone |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["mixes"]:
        lines.append(f"| {r['deterministic_fraction']:.0%} | {r['completed']}/{r['requests']} | {r['status_5xx']} "
                     f"| {r['errors']} | {r['wall_s']} | {r['throughput_req_s']} | {r['throughput_tok_s']} "
                     f"| {r['latency_p50_s']} | {r['latency_p99_s']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} "
                     f"| {r['mean_batch_size']} | {r['prefix_cache_hits']}/{r['requests']} "
                     f"| {r['identical']}/{r['compared_with_alone']} |")
    mp, cv, ts = report["mixed_policies"], report["conversations"], report["shared_system_prompt"]
    d, b, s = report["disconnects"], report["burst"], report["sigterm"]
    lines += [
        "",
        "## Determinism under concurrency",
        "",
        f"- **8 concurrent streaming clients, mixed policies** ({', '.join(mp['policies'])}), held-in prompts, "
        f"{mp['waves']} waves: {mp['completed']}/{mp['requests']} complete, {mp['status_5xx']} 5xx; every "
        f"guaranteed stream equals the request alone: **{mp['identical']}/{mp['compared_with_alone']}** "
        "(`fast` and the explicit non-strict margin promise nothing and are not compared).",
        f"- **8 concurrent 3-turn conversations** (one system prompt, the same mixed policies): "
        f"{cv['completed']}/{cv['requests']} turns complete, {cv['turns_with_cached_prefix']} of them served a "
        f"cached prefix (mean {cv['cached_tokens_per_turn_mean']} prompt tokens reused per turn, "
        f"{cv['prefix_cache_hits']} prefix-cache hits); every guaranteed turn equals the request alone: "
        f"**{cv['identical']}/{cv['compared_with_alone']}**.",
        "",
        "## Prefix cache: a long shared system prompt",
        "",
        f"A system prompt of about {ts['system_prompt_tokens_about']} tokens; cold = never sent before, hit = the "
        f"same system prompt with another question ({ts['cached_tokens_on_hit']} prompt tokens from the cache). "
        f"Median of {ts['reps']}: TTFT cold **{ts['ttft_cold_p50_s']} s**, hit **{ts['ttft_hit_p50_s']} s**: "
        f"**{ts['ttft_factor']}x** faster. The cold request sent again (a hit) gave the cold run's tokens: "
        f"**{ts['hit_equals_cold_tokens']}**.",
        "",
        "## Faults",
        "",
        f"- **Disconnects:** {d['streams']} streams closed after their first token: {d['disconnects_counted']} "
        f"disconnects counted, every KV block free again {d['all_blocks_free_after_s']} s after the last close.",
        f"- **Burst beyond the queue:** {b['sent']} requests at once against a capacity of {b['capacity']} "
        f"(running + queued): {b['status_429']} got 429, {b['accepted']} accepted, {b['accepted_complete']} "
        f"completed in full, **{b['lost']} lost**; equal to alone: {b['identical']}/{b['compared_with_alone']}.",
        f"- **SIGTERM under load:** {s['in_flight_at_sigterm']} streams in flight; {s['completed_in_full']} "
        f"finished in full; the server exited with code {s['exit_code']}.",
        "",
        f"**Overall: {report['totals']['compared']} responses compared with the request alone, "
        f"{report['totals']['mismatches']} mismatches; {report['totals']['status_5xx']} 5xx; "
        f"{report['totals']['lost']} lost.**",
    ]
    if report["totals"]["mismatch_examples"]:
        lines += ["", "Mismatches: " + "; ".join(report["totals"]["mismatch_examples"])]
    return "\n".join(lines) + "\n"
