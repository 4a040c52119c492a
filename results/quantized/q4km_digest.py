"""The 1B Q4_K_M kept quantized under the bf16-bits contract (--weights exact) gives the tokens of its
dequantized model (--weights bf16), batched under batch-invariant. Usage: python q4km_digest.py FILE.gguf"""
import hashlib
import json
import sys

from margingate.data.prompts import builtin_prompts
from margingate.llm import LLM

prompts = builtin_prompts()[:4]
digests = {}
for weights in ("exact", "bf16"):
    llm = LLM(sys.argv[1], weights=weights, policy="batch-invariant")
    out = llm.generate(prompts, max_new_tokens=24, ignore_eos=True)
    ids = [c.token_ids for c in out]
    digests[weights] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
    print(f"--weights {weights}: token ids sha256 {digests[weights]}", flush=True)
    del llm
print("equal" if digests["exact"] == digests["bf16"] else "DIFFERENT")
