"""Flags are typed exactly: no argparse parser in the project takes an abbreviation
(`--speculative-ddtree-bud 8` was silently `--speculative-ddtree-budget 8`), and `ddtree generate`
takes the engine's flags, not the HTTP server's (they would not act there), with a short
`--help` (its own flags, the engine's by group) and `--help=all` / `--help=GROUP` for the rest.
< 5 s."""

import ast
import dataclasses
import subprocess

import pytest
from server_fixtures import REPO_ROOT

from ddtree import generate
from ddtree.config.args import FLAG_GROUPS, SERVER_ONLY_GROUPS, ServerArgs, cli_fields, flag

TYPO = ["--speculative-ddtree-bud", "8"]


def parser_calls():
    """(file:line, call) of every ArgumentParser(...) / .add_parser(...) call outside the tests."""
    files = subprocess.check_output(["git", "ls-files", "*.py"], cwd=REPO_ROOT, text=True).split()
    for path in files:
        if path.startswith("tests/"):
            continue
        with open(f"{REPO_ROOT}/{path}", encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in ("ArgumentParser", "add_parser"):
                    yield f"{path}:{node.lineno}", node


def test_every_parser_refuses_abbreviations():
    calls = list(parser_calls())
    assert len(calls) > 20  # the scan sees the project's parsers
    lax = [
        where
        for where, node in calls
        if not any(
            k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in node.keywords
        )
    ]
    assert lax == [], f"pass allow_abbrev=False to: {lax}"


@pytest.mark.parametrize("command", ["serve", "check-config", "generate", "train-target", "bench"])
def test_an_abbreviated_flag_is_an_error(command, capsys):
    from ddtree.cli import main

    argv = {
        "train-target": ["train-target", "--corpus", "x", "--out", "y", "--step", "1"],
        "bench": ["bench", "acceptance", "--budget", "8"],
    }.get(command, [command, *TYPO])
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_prepare_server_args_refuses_an_abbreviation():
    from ddtree.config import prepare_server_args

    with pytest.raises(SystemExit):
        prepare_server_args(TYPO)


def test_flag_groups_cover_every_flag_once():
    grouped = [name for names in FLAG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in cli_fields())
    assert len(grouped) == len(set(grouped))


def test_generate_takes_the_engine_flags_and_refuses_the_servers():
    parser = generate.make_parser()
    taken = {s for a in parser._actions for s in a.option_strings}
    for title, names in FLAG_GROUPS.items():
        for name in names:
            assert (flag(name) in taken) == (title not in SERVER_ONLY_GROUPS), name
    for server_only in (["--port", "8000"], ["--dp-size", "2"]):
        with pytest.raises(SystemExit):
            parser.parse_args(server_only)
    ns = parser.parse_args(["--max-tokens", "3", "--cpu-threads", "1"])
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    assert ns.cpu_threads == 1 and ns.max_tokens == 3 and "help" not in fields


def test_generate_help_is_short_and_points_to_the_rest(capsys):
    assert generate.main(["--help"]) == 0
    short = capsys.readouterr().out
    assert len(short.splitlines()) < 60, short
    assert "--max-tokens" in short and "--compare-ar" in short and "--help=all" in short
    for title in FLAG_GROUPS:
        assert (f"  {title}: " in short) == (title not in SERVER_ONLY_GROUPS), title
    assert "--speculative-ddtree-budget" in short and "--port" not in short
    assert generate.main(["--help=all"]) == 0
    full = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "the largest budget --speculative-ddtree-budget auto picks" in full
    assert generate.main(["--help=speculative"]) == 0
    one = capsys.readouterr().out
    assert "--speculative-ddtree-topk-cap" in one and "--mem-fraction-static" not in one
    assert generate.main(["--help=nope"]) == 2
    assert "groups: model, speculative" in capsys.readouterr().err
