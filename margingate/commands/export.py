"""`margingate export`: a model's weights as a GGUF that llama.cpp reads: BF16, or with `--quantize` the very
blocks `--quantize` runs at load, so that the file and the folder give the same tokens (models/gguf_export.py)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from .. import cli_args
from ..models.named import DEFAULT_MODEL, NAMED


def add_parser(sub) -> None:
    e = sub.add_parser("export", help="write a model's weights as a GGUF (BF16, or --quantize q8_0|q4_k)")
    e.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"a Hugging Face folder, a named model ({', '.join(NAMED)}) or a .gguf file; "
                        f"--quantize takes a folder (default {DEFAULT_MODEL})")
    cli_args.add_quantize_arg(e, "as `--quantize` does at load: the same tokens and logprobs")
    e.add_argument("--out", type=Path, default=None, help="the GGUF file to write (default: ./FOLDER.TYPE.gguf)")
    e.set_defaults(func=cmd_export)


def cmd_export(args) -> None:
    import gguf

    from ..models.gguf_export import write_atomically, write_gguf
    from ..models.loader import resolve_model_dir
    from ..models.quantize import check_source

    check_source(args.model, args.quantize)  # before converting anything
    folder = resolve_model_dir(args.model)
    out = args.out or Path(f"{folder.name}.{args.quantize or 'bf16'}.gguf")
    write_atomically(out, lambda tmp: write_gguf(folder, tmp, args.quantize))
    kinds = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB; tensors "
          + ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()))
