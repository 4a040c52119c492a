"""margingate: an LLM inference engine."""
