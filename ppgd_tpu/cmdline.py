"""The flags library every `ppgd-tpu` command parses its command line with.

- Config commands (train, eval, pretrain, bench, shardings, compile, sweep):
  `parse_config_args` makes every config field an absl flag named by its dotted path
  (`--decomp.steps=2000`), typed by the schema, beside the command's own flags.
- The other commands (tokenize, ckpt, launch-local): `parse_flags`, the command's own
  flags only, plus positional arguments.

A command's own flag is a `Flag`: its default text (None: required; a bool: a switch,
`--exec` / `--noexec`), its help, and a parser (`count`, `counts`, `choice(...)`,
`integer(...)`, `optional(...)`, or any function) that turns the text into the value or
raises ValueError saying what is valid. Every refused command line raises `UsageError`
naming the flag and what is valid; the entry point (cli.py) says it in one line and exits
2, before any compute and without touching a run directory. `--helpfull` (or `--help`,
`-h`) prints the command's flags and exits 0. `output_path` checks a flag's output path the
same way, before any compute.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from absl import flags

from ppgd_tpu import config as config_lib
from ppgd_tpu import storage
from ppgd_tpu.config import ConfigError

HELP = ("--helpfull", "--help", "-h")


class UsageError(ConfigError):
    """A bad command line (exit 2)."""


class Flag(NamedTuple):
    """A command's own flag (a plain tuple `(default, help[, parse])` is read as one)."""

    default: str | bool | None  # the text parsed when the flag is absent; None: required
    help: str
    parse: Callable[[str], Any] | None = None  # None: the text itself
    repeated: bool = False  # `--input a --input b`: the list of each one's value


def split_value(args: list[str], name: str) -> str | None:
    """The value of --name in args (either --name=V or --name V), without parsing the rest;
    the last one if repeated, as absl takes every other flag's."""
    value = None
    for i, a in enumerate(args):
        if a == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(f"--{name}="):
            value = a.split("=", 1)[1]
    return value


def named(args: list[str]) -> dict[str, str | None]:
    """{name: value text} of every `--name=V` / `--name V` in args (V None if absent)."""
    out = {}
    for a in args:
        if a.startswith("--"):
            name = a[2:].split("=", 1)[0]
            out[name] = split_value(args, name)
    return out


def join_values(args: list[str], names) -> list[str]:
    """`--name value` -> `--name=value` for these (string) flags, as absl expects."""
    out, i = [], 0
    while i < len(args):
        if args[i] in {f"--{n}" for n in names} and i + 1 < len(args):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def count(text: str) -> int:
    """A command flag's value that counts something: a whole number >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError("use a whole number >= 1")
    return int(text)


def counts(text: str) -> list[int]:
    """Comma-separated counts (`1,4`); empty: none."""
    try:
        return [count(c) for c in text.split(",")] if text else []
    except ValueError:
        raise ValueError("use comma-separated whole numbers >= 1, e.g. 1,4") from None


def choice(*options: str):
    """A command flag's value from a fixed set."""
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"use one of {', '.join(options)}")
        return text
    return parse


def integer(low: int | None = None, high: int | None = None):
    """A whole number, at least `low` and at most `high` where they are given."""
    valid = "use a whole number" + (f" >= {low}" if high is None and low is not None else
                                    f" from {low} to {high}" if high is not None else "")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(valid) from None
        if low is not None and value < low or high is not None and value > high:
            raise ValueError(valid)
        return value
    return parse


def optional(parse: Callable[[str], Any]):
    """`parse`, but the empty text (an optional flag left out) gives None."""
    return lambda text: parse(text) if text else None


def output_path(flag: str, path: str, *, directory: bool) -> str:
    """`path`, given by --flag, once it is known it could be created and written
    (storage.check_creatable): else UsageError naming the flag, before any compute."""
    try:
        storage.check_creatable(path, directory=directory)
    except ValueError as e:
        raise UsageError(f"--{flag}: {e}") from None
    return path


# ---------------------------------------------------------------- parsing


def _flags(own: dict[str, tuple]) -> dict[str, Flag]:
    return {name: Flag(*spec) for name, spec in own.items()}


def _define_own(fv: flags.FlagValues, own: dict[str, Flag]) -> None:
    for name, f in own.items():
        if isinstance(f.default, bool):
            flags.DEFINE_boolean(name, f.default, f.help, flag_values=fv)
        elif f.repeated:
            flags.DEFINE_multi_string(name, None, f.help, flag_values=fv)
        else:
            flags.DEFINE_string(name, f.default, f.help, flag_values=fv)


def _own_help(own: dict[str, Flag]) -> list[str]:
    lines = []
    for name, f in own.items():
        if isinstance(f.default, bool):
            lines.append(f"  --[no]{name}  {f.help} (default {str(f.default).lower()})")
        else:
            value = "VALUE (required)" if f.default is None else f.default
            lines.append(f"  --{name}={value}  {f.help}"
                         + (" (repeatable)" if f.repeated else ""))
    return lines


def _parse(fv: flags.FlagValues, args: list[str], known: list[str],
           bad_value: Callable[[str], str] = str) -> list[str]:
    """Parses args into fv -> the positional arguments; absl's errors as UsageError."""
    try:
        return fv(["ppgd-tpu", *args])[1:]
    except flags.UnrecognizedFlagError as e:
        close = difflib.get_close_matches(e.flagname, known, n=3)
        hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
        raise UsageError(f"--{e.flagname}: unknown flag{hint} (see --helpfull)") from None
    except flags.IllegalFlagValueError as e:
        raise UsageError(bad_value(str(e))) from None
    except flags.Error as e:
        raise UsageError(str(e)) from None


def _own_values(fv: flags.FlagValues, own: dict[str, Flag]) -> dict[str, Any]:
    """{name: value} of the command's own flags: each text through its parser."""
    missing = [n for n, f in own.items() if f.default is None and not fv[n].present]
    if len(missing) == 1:
        raise UsageError(f"--{missing[0]}: required ({own[missing[0]].help})")
    if missing:
        raise UsageError(f"{', '.join('--' + n for n in missing)}: required (see --helpfull)")
    values = {}
    for name, f in own.items():
        value = fv[name].value
        if isinstance(f.default, bool) or f.parse is None:
            values[name] = value
            continue
        parsed = []
        for text in value or [] if f.repeated else [value]:
            try:
                parsed.append(f.parse(text))
            except ValueError as e:
                raise UsageError(f"--{name}={text!r}: {e}") from None
        values[name] = parsed if f.repeated else parsed[0]
    return values


def parse_flags(args: list[str], own: dict[str, tuple], usage: str
                ) -> tuple[dict[str, Any], list[str]]:
    """Parses a command line of the command's own flags only (`own`: name -> Flag) ->
    ({name: value}, the positional arguments). `--helpfull` prints `usage` and the flags,
    then exits 0."""
    own = _flags(own)
    if any(a in HELP for a in args):
        print("\n".join([usage, *(["", "flags:", *_own_help(own)] if own else [])]))
        raise SystemExit(0)
    fv = flags.FlagValues()
    _define_own(fv, own)
    positional = _parse(fv, args, list(own))
    return _own_values(fv, own), positional


def _define(fv: flags.FlagValues, path: str, tp, default, help_: str) -> None:
    kw = dict(flag_values=fv, help=f"{help_} (default {default!r})")
    if typing.get_origin(tp) is Literal:
        flags.DEFINE_enum(path, None, [str(a) for a in typing.get_args(tp)], **kw)
    elif tp is bool:
        flags.DEFINE_boolean(path, None, **kw)
    else:  # numbers too: typed by config._coerce, as a YAML value is (`--decomp.steps=2e4`)
        flags.DEFINE_string(path, None, **kw)


def _bad_value(message: str, leaves: dict) -> str:
    """absl's "flag --PATH=VALUE: <parser's words>" in the words a bad YAML value gets."""
    m = re.match(r"flag --([^=]+)=(.*?): ", message, re.S)
    if not m or m.group(1) not in leaves:
        return message
    return str(config_lib.not_a(m.group(1), m.group(2), leaves[m.group(1)]))


def parse_config_args(args: list[str], extra: dict[str, tuple] | None = None,
                      base: config_lib.Config | None = None, shown: tuple[str, ...] = ("",)):
    """Parses `[--config PATH] [--<dotted.field>=V ...] [extra flags]` -> (Config, extras).
    With `base` (a run's config), the fields start from it and --config is not a flag;
    --helpfull lists the fields whose path starts with one of `shown`.

    `extra` maps a command's own flag names to a `Flag` (or its tuple): its parser turns
    the string into its value or raises ValueError saying what is valid, which exits 2
    naming the flag. The YAML file is loaded first so its dict entries (recon terms, site
    patterns) get flags too, as do the new entries a flag names
    (`--decomp.tie.linear2=linear1`, config.with_entries).
    """
    extra = _flags(extra or {})
    args = join_values(args, ["config", *extra] if base is None else list(extra))
    path = split_value(args, "config") if base is None else None
    cfg = config_lib.with_entries(base or config_lib.read(path), named(args))
    fv = flags.FlagValues()
    if base is None:
        flags.DEFINE_string("config", None, "experiment YAML (none: the embedded default)",
                            flag_values=fv)
    _define_own(fv, extra)
    leaves = {p: tp for p, tp, _, _ in config_lib.leaves(cfg)}
    for p, tp, value, help_ in config_lib.leaves(cfg):
        _define(fv, p, tp, value, help_)
    if any(a in HELP for a in args):
        if base is None:
            print(f"flags (with --config {path or '<embedded default>'}):")
            print("  --config=PATH  experiment YAML")
        else:
            print("flags (a field's default is its value in RUN_DIR/config.yaml):")
        for line in _own_help(extra):
            print(line)
        print(config_lib.describe(cfg, shown))
        raise SystemExit(0)
    positional = _parse(fv, args, list(leaves) + list(extra),
                        lambda message: _bad_value(message, leaves))
    if positional:
        raise UsageError(f"unexpected arguments {positional}; flags look like --decomp.steps=100")
    cfg = config_lib.with_overrides(cfg, {p: fv[p].value for p in leaves if fv[p].present})
    return cfg, _own_values(fv, extra)
