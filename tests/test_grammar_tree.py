"""The host-side grammar pieces on the char tokenizer (one token per printable character): the
bitmask's device application (xgrammar's kernel vs the PyTorch reference), the draft tree under
a grammar (every node's path is grammar-valid, each node's mask is the matcher's at that node,
parents precede children depth by depth, the budget is spent, forced stretches drafted whole),
and the compile cache. ~3 s."""

import json

import numpy as np
import pytest
import torch
from server_fixtures import CHARS, EOS_ID, save_char_tokenizer

from ddtree.grammar import GrammarError, Grammars, GrammarSpec
from ddtree.grammar.backend import allowed, only_token
from ddtree.grammar.masks import apply_bitmask_reference, unpack, unpack_torch
from ddtree.grammar.tree import build_grammar_tree

V = 97
ID = {c: i for i, c in enumerate(CHARS)}


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = str(tmp_path_factory.mktemp("chartok"))
    save_char_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def grammars(char_tokenizer):
    return Grammars(char_tokenizer, V, (EOS_ID,))


def test_apply_bitmask_reference_matches_xgrammar():
    import xgrammar

    g = torch.Generator().manual_seed(0)
    for vocab in (97, 128, 1000):
        words = (vocab + 31) // 32
        masks = torch.randint(-(2**31), 2**31 - 1, (7, words), generator=g, dtype=torch.int32)
        logits = torch.randn(7, vocab, generator=g)
        ours, theirs = logits.clone(), logits.clone()
        apply_bitmask_reference(ours, masks)
        xgrammar.apply_token_bitmask_inplace(theirs, masks, vocab_size=vocab, backend="cpu")
        assert torch.equal(ours, theirs)
        keep = unpack(masks, vocab)
        assert torch.equal(ours == float("-inf"), ~keep)
        assert torch.equal(unpack_torch(masks, vocab), keep)


def test_only_token_and_allowed():
    row = np.zeros(4, dtype=np.int32)
    assert only_token(row) == -1
    row[2] = np.int32(1 << 5)
    assert only_token(row) == 69
    assert allowed(row, np.array([69, 68, 5])).tolist() == [True, False, False]
    row[0] = 1
    assert only_token(row) == -1
    row[:] = 0
    row[1] = np.int32(-(2**31))  # bit 31: token 63
    assert only_token(row) == 63


def walk(matcher, path):
    n = matcher.accept_all(path)
    matcher.rollback(n)
    return n == len(path)


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("forced", [True, False])
def test_tree_is_grammar_valid(grammars, chain, forced):
    spec = GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["name", "n"],
        }
    )
    m = grammars.matcher(spec)
    prefix = '{"name": "ab'  # xgrammar's separators without free whitespace: json.dumps'
    assert m.accept_all([ID[c] for c in prefix]) == len(prefix)
    root = ID["b"]
    D, K, n, budget = 6, 12, 20, 16
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(V)[:K] for _ in range(D)])
    ids[:, 0] = [ID[c] for c in 'c"x,n:']  # some valid, some not
    logp = np.sort(rng.normal(size=(D, K)))[:, ::-1] - 3.0
    masks = torch.zeros(n, grammars.words, dtype=torch.int32)
    gt = build_grammar_tree(m, root, logp, ids, budget, D, n, masks, chain=chain, forced=forced)
    assert m.accept_all([]) == 0 and walk(m, [ID["c"]])  # the matcher is back at its state
    assert gt.tokens[0] == root and 1 < gt.nodes <= budget + 1
    if chain:
        assert list(gt.parents[1 : gt.nodes]) == list(range(gt.nodes - 1))
    depth = [0] * n
    for i in range(1, gt.nodes):
        p = int(gt.parents[i])
        assert 0 <= p < i
        depth[i] = depth[p] + 1
        assert depth[i] >= depth[i - 1]  # by depth
    assert all(p == -1 for p in gt.parents[gt.nodes :])
    scratch = torch.zeros(1, grammars.words, dtype=torch.int32)
    for i in range(gt.nodes):
        path, j = [], i
        while j > 0:
            path.append(int(gt.tokens[j]))
            j = int(gt.parents[j])
        path.reverse()
        assert m.accept_all(path) == len(path), "every node's path is grammar-valid"
        m.fill(scratch, 0)
        assert torch.equal(scratch[0], masks[i]), "the node's mask is the matcher's there"
        m.rollback(len(path))
    if forced:  # after '{"name": "abc"' the grammar forces ', "n": ' - drafted at log-prob 0
        tree_paths = set()
        for i in range(gt.nodes):
            path, j = [], i
            while j > 0:
                path.append(CHARS[int(gt.tokens[j])])
                j = int(gt.parents[j])
            tree_paths.add("".join(reversed(path)))
        assert 'c", "n' in tree_paths, sorted(tree_paths)


def test_compile_cache_and_errors(grammars):
    a = GrammarSpec.regex("[a-c]+")
    assert not grammars.cached(a)
    first = grammars.compile(a)
    assert grammars.cached(a) and grammars.compile(GrammarSpec.regex("[a-c]+")) is first
    with pytest.raises(GrammarError):
        grammars.compile(GrammarSpec.regex("(unclosed"))
    with pytest.raises(GrammarError):
        grammars.compile(GrammarSpec("json_schema", '{"type": "nonsense"}'))
    with pytest.raises(GrammarError):
        grammars.compile(GrammarSpec("ebnf", "root ::= missing_rule"))
    m = grammars.matcher(GrammarSpec.choice(['say "hi"', "b"]))
    assert m.accept_all([ID[c] for c in 'say "hi"']) == 8 and m.accept(EOS_ID) and m.terminated
    assert json.loads(GrammarSpec.choice(["x"]).source) == ["x"]


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.regex('[a-z]{1,4}( [0-9]+)?"?'),
        GrammarSpec.json_schema({"type": "object", "properties": {"k": {"type": "string"}}}),
    ],
)
def test_model_vocab_padded_past_the_tokenizer(char_tokenizer, spec):
    """A model whose embedding has rows past the tokenizer's ids (a padded vocab; the inflated
    benchmark pairs pad 8k to 151,936): xgrammar is given the tokenizer's ids only (each padding
    id it sees is a special token that every accept scans), and the rows keep the model's width
    with the padding never allowed - token for token the masks of xgrammar over the padded
    vocab, whatever the row held before."""
    import xgrammar as xgr

    padded = 300  # not a multiple of 32: 10 words, the tokenizer's 97 ids end inside word 3
    ours = Grammars(char_tokenizer, padded, (EOS_ID,))
    assert ours.tokenizer_vocab == V and ours.words == 10
    info = xgr.TokenizerInfo.from_huggingface(
        char_tokenizer, vocab_size=padded, stop_token_ids=[EOS_ID]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    if spec.kind == "regex":
        compiled = compiler.compile_regex(spec.source)
    else:
        compiled = compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
    ref = xgr.GrammarMatcher(compiled)
    m = ours.matcher(spec)
    rng = np.random.default_rng(1)
    row = torch.empty(2, 10, dtype=torch.int32)
    want = torch.empty(1, 10, dtype=torch.int32)
    for _ in range(12):
        row.fill_(-1)  # garbage: every word of the row must be written
        m.fill(row, 1)
        ref.fill_next_token_bitmask(want, 0)
        # bits past the model's vocabulary mean nothing (xgrammar leaves some set there)
        assert torch.equal(unpack(row[1:], padded), unpack(want, padded))
        assert torch.equal(row[0], torch.full((10,), -1, dtype=torch.int32))  # other rows kept
        ok = np.flatnonzero(unpack(row[1:], padded)[0].numpy())
        ok = ok[ok != EOS_ID]
        if m.terminated or len(ok) == 0:
            break
        t = int(rng.choice(ok))
        assert m.accept(t) and ref.accept_token(t)
