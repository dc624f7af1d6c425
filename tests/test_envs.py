"""The environment switches: every `DDTREE_*` name in the code, tests, bench/ and docs is in
`envs.TABLE` (the history pages, docs/history and docs/results, keep the names of switches that are
gone), and only ddtree/envs.py reads one from `os.environ`."""

import io
import os
import re
import tokenize

import pytest

from ddtree import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"(?<![A-Za-z0-9_$])\$?(DDTREE_[A-Z0-9_]+)")
# an os.environ read with a literal name (get / [] / getenv); writes in tests (monkeypatch.setenv)
# are fine
RAW_READ = re.compile(r"(environ\.get\(|environ\[|getenv\()\s*[\"']DDTREE_")


HISTORY = tuple(os.path.join(ROOT, "docs", d) for d in ("history", "results"))


def _files(exts):
    for top in ("ddtree", "tests", "studies", "docs"):
        for d, _, names in os.walk(os.path.join(ROOT, top)):
            if not d.startswith(HISTORY):
                yield from (os.path.join(d, n) for n in names if n.endswith(exts))
    yield os.path.join(ROOT, "README.md")


def env_names_in(path: str) -> set[str]:
    """DDTREE_* names in a file's strings and comments (.py; Python identifiers such as
    DDTREE_FIELDS are not environment variables) or its whole text (docs)."""
    text = open(path, encoding="utf-8").read()
    if not path.endswith(".py"):
        return set(NAME.findall(text))
    found = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(
            tokenize, "FSTRING_MIDDLE", -1
        ):
            found |= set(NAME.findall(tok.string))
    return found


def test_every_ddtree_name_is_in_the_table():
    missing = {}
    for path in _files((".py", ".md")):
        # its control uses made-up names
        if os.path.exists(path) and path != os.path.abspath(__file__):
            for name in env_names_in(path) - set(envs.TABLE):
                missing.setdefault(name, []).append(os.path.relpath(path, ROOT))
    assert not missing, f"DDTREE_* names not in ddtree/envs.py TABLE: {missing}"


def test_no_raw_environ_reads_outside_envs():
    bad = [
        os.path.relpath(p, ROOT)
        for p in _files((".py",))
        if p not in (os.path.join(ROOT, "ddtree", "envs.py"), os.path.abspath(__file__))
        and RAW_READ.search(open(p).read())
    ]
    assert not bad, f"read DDTREE_* switches through ddtree.envs, not os.environ: {bad}"


def test_the_scan_can_fail(tmp_path):
    """Control: a name used only in a string is found; a Python identifier is not."""
    p = tmp_path / "x.py"
    p.write_text(
        'DDTREE_FIELDS = 1\nx = os.environ.get("DDTREE_NOT_A_SWITCH")  # see $DDTREE_CACHE\n'
    )
    assert env_names_in(str(p)) == {"DDTREE_NOT_A_SWITCH", "DDTREE_CACHE"}
    assert RAW_READ.search(p.read_text())


@pytest.mark.parametrize(
    "value,want",
    [("", False), ("0", False), ("off", False), ("No", False), ("1", True), ("yes", True)],
)
def test_flag_values(monkeypatch, value, want):
    monkeypatch.setenv(envs.FUSED_KERNELS_INTERPRET.name, value)
    assert envs.FUSED_KERNELS_INTERPRET.on() is want
    monkeypatch.delenv(envs.FUSED_KERNELS_INTERPRET.name)
    assert envs.FUSED_KERNELS_INTERPRET.on() is False and envs.ROUND_CLOCK.get() == "1"
    assert (
        all(v.help for v in envs.TABLE.values()) and "DDTREE_REFERENCE=<unset>" in envs.describe()
    )


@pytest.mark.parametrize(
    "value,chosen",
    [
        ("", set()),
        ("gdn", {"gdn"}),
        (" GDN , attention,", {"gdn", "attention"}),
        ("all", set(envs.REFERENCE.parts)),
    ],
)
def test_part_lists(monkeypatch, value, chosen):
    monkeypatch.setenv(envs.REFERENCE.name, value)
    assert envs.REFERENCE.chosen() == chosen
    assert all(envs.REFERENCE.has(p) is (p in chosen) for p in envs.REFERENCE.parts)


def test_unknown_part_is_refused_naming_the_valid_ones(monkeypatch):
    """A typo (or a retired switch's value, 1) never silently leaves a part on its kernel."""
    for value in ("1", "gdn,atention"):
        monkeypatch.setenv(envs.REFERENCE.name, value)
        with pytest.raises(ValueError, match="DDTREE_REFERENCE=.*attention, kernels, tree_build"):
            envs.REFERENCE.has("gdn")
    monkeypatch.delenv(envs.REFERENCE.name)
    with pytest.raises(KeyError, match="pdl"):
        envs.REFERENCE.has("pdl")  # a part of DDTREE_DISABLE, not of DDTREE_REFERENCE


def test_at_most_twelve_switches():
    """Issue 56: variants live in constructor, CLI or study arguments; the environment keeps a
    short list (TRITON_INTERPRET is Triton's own)."""
    ours = [n for n in envs.TABLE if n.startswith("DDTREE_")]
    assert len(ours) <= 12, ours
