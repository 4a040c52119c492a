"""Constrained decoding's cost per token against unconstrained, at B = 1 and B = 16, side by side in
one process (batch-invariant, the embedded model, greedy). `json`: a JSON schema whose answers run
long (an array of strings); `regex`: letters and spaces for every token. Per generated token:
the whole step (forward, mask, sampling) divided by the tokens it emitted."""
from __future__ import annotations

import time

from margingate.engine import Request
from margingate.engine.sampling import SamplingParams
from margingate.engine.structured import StructuredOutput
from margingate.llm import LLM

TOKENS = 32
LIST = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
        "required": ["items"]}
CASES = {"unconstrained": None, "json schema": StructuredOutput(json=LIST),
         "regex": StructuredOutput(regex="[a-z ]{1,400}")}


def ms_per_token(llm: LLM, prompt_ids: list[int], batch: int, constraint) -> float:
    reqs = [Request(prompt_ids, TOKENS, llm.policy("batch-invariant"), request_id=f"b{i}",
                    sampling=SamplingParams(temperature=0.8, seed=i, structured=constraint)) for i in range(batch)]
    t = time.perf_counter()
    out = llm.engine.generate(reqs)
    return (time.perf_counter() - t) * 1e3 / sum(len(r.token_ids) for r in out)


def main() -> None:
    llm = LLM(max_num_seqs=16)
    prompt = llm.requests([{"role": "user", "content": "List forty fruits."}])[0].prompt_ids
    llm.grammars.compile(CASES["json schema"])  # the tokenizer table and the compile, before timing
    for batch in (1, 16):
        ms_per_token(llm, prompt, batch, None)  # warm
        row = {name: ms_per_token(llm, prompt, batch, c) for name, c in CASES.items()}
        base = row["unconstrained"]
        print(f"B = {batch:2d}: " + ", ".join(f"{k} {v:.2f} ms/token ({v / base:.2f}x)" for k, v in row.items()))


if __name__ == "__main__":
    main()
