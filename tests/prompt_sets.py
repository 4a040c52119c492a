"""The prompt sets the tests share, as indices into the built-in prompts."""

# Heterogeneous batches: math, code, chat and instruction prompts, chat and raw-text kinds,
# prompt lengths from ~30 to ~100 tokens.
HET16 = [0, 19, 10, 20, 30, 39, 25, 5, 2, 8, 12, 23, 31, 36, 15, 35]
HET8 = HET16[:8]
EOS_STOPPERS = [31, 36]  # in HET16; their references emit EOS within 64 tokens (kernels v6)
SPREAD8 = [0, 7, 13, 20, 26, 31, 35, 38]  # one batch spread over the four categories
