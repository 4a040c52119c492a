"""Each engine knob is declared once (`options/engine.py`: its type, default, bounds, choices, help, flag), and
the three places that take it agree with the declaration: every command's flag (its default, and what
`cli_args.engine_options` reads back into `LLM`), `LLM`'s keywords, and `EngineConfig`. A planted
disagreement is caught (the check can fail)."""
from __future__ import annotations

import argparse
import inspect

import pytest

from margingate import cli_args
from margingate.cli import build_parser
from margingate.options.engine import EngineConfig, engine_config, engine_knobs

KNOBS = engine_knobs()
DECLARED = {name: f.default for name, (f, _) in KNOBS.items()}


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def cli_defaults(parser: argparse.ArgumentParser) -> dict[tuple[str, str], object]:
    """{(command, knob): its flag's default} for every command that has the knob's flag."""
    out = {}
    for command, p in commands(parser).items():
        for name, (_, k) in KNOBS.items():
            action = p._option_string_actions.get(cli_args.flag(name)) if k.flag != "" else None
            if action is not None:
                out[command, name] = action.default
    return out


def llm_defaults() -> dict[str, object]:
    """What `LLM` builds for each knob a caller leaves out: a keyword of its own, or `EngineConfig`'s through
    `**engine` (options/engine.py's `engine_config`)."""
    from margingate.llm import LLM

    params = inspect.signature(LLM.__init__).parameters
    built = engine_config({})
    return {name: params[name].default if name in params else getattr(built, name) for name in KNOBS}


def disagreements(cli: dict, llm: dict, config: EngineConfig) -> list[str]:
    found = [f"{command} {cli_args.flag(name)} defaults to {value!r}, the declaration to {DECLARED[name]!r}"
             for (command, name), value in sorted(cli.items()) if value != DECLARED[name]]
    found += [f"LLM's {name} defaults to {value!r}, the declaration to {DECLARED[name]!r}"
              for name, value in llm.items() if value != DECLARED[name]]
    found += [f"EngineConfig's {name} defaults to {getattr(config, name)!r}, the declaration to {DECLARED[name]!r}"
              for name in KNOBS if getattr(config, name) != DECLARED[name]]
    return found


def test_each_knobs_cli_llm_and_engine_config_defaults_agree():
    cli = cli_defaults(build_parser())
    assert {name for _, name in cli} == {n for n, (_, k) in KNOBS.items() if k.flag != ""}  # every flag seen
    assert {c for c, name in cli if name == "max_num_seqs"} == {"generate", "score", "serve"}
    assert disagreements(cli, llm_defaults(), EngineConfig()) == []


def test_a_disagreeing_default_is_caught():
    """The control: a command's flag, an `LLM` keyword and an `EngineConfig` each planted with another default."""
    parser = build_parser()
    commands(parser)["serve"]._option_string_actions["--kv-block-size"].default = 32
    llm = {**llm_defaults(), "max_num_seqs": 16}
    found = disagreements(cli_defaults(parser), llm, EngineConfig(max_num_batched_tokens=2048))
    assert found == ["serve --kv-block-size defaults to 32, the declaration to 16",
                     "LLM's max_num_seqs defaults to 16, the declaration to 64",
                     "EngineConfig's max_num_batched_tokens defaults to 2048, the declaration to 4096"]


def test_every_command_reads_its_flags_back_as_the_declared_engine():
    """What `cli_args.llm` hands `LLM` from a command's defaults (the prefix cache switched off) is the declared
    engine, knob for knob; and a flag's bounds and choices are the declaration's."""
    for command, p in commands(build_parser()).items():
        if "--kv-block-size" not in p._option_string_actions:
            continue  # no engine of its own
        args = argparse.Namespace(**{a.dest: a.default for a in p._actions})
        args.prefix_cache = False
        options = cli_args.engine_options(args, DECLARED["max_num_seqs"])
        assert engine_config(options) == EngineConfig(), command
    serve = commands(build_parser())["serve"]
    with pytest.raises(SystemExit):
        serve.parse_args(["--max-model-len", "1"])  # the declared minimum, 2
    assert serve._option_string_actions["--kv-cache-dtype"].choices == KNOBS["kv_cache_dtype"][1].choices


def test_an_unknown_or_out_of_bounds_knob_is_refused_by_name():
    with pytest.raises(TypeError, match="unknown engine option max_num_seq;"):
        engine_config({"max_num_seq": 4})
    with pytest.raises(ValueError, match="kv_cache_memory must be > 0 GB, got 0"):
        EngineConfig(kv_cache_memory=0)


def test_the_session_llm_runs_the_declared_engine(llm):
    """`LLM(max_num_seqs=16)` (the session's facade): every other knob as declared, in the engine it built."""
    assert llm.engine.config == EngineConfig(max_num_seqs=16)
