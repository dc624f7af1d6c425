"""What stopped a request, and special tokens, in its text (engine/outputs/emitter.py): as vLLM and SGLang,
a stop token's text and a stop string are left out unless `include_stop_str_in_output` (SGLang's
`no_stop_trim`); special tokens only with `skip_special_tokens=False`. Both emit paths: deferred
detokenisation (no stop strings) and token by token (stop strings). A fake tokenizer with
multi-character tokens; < 1 s."""

import pytest

from ddtree.engine.outputs.detokenizer import StopMatcher
from ddtree.engine.outputs.emitter import TokenEmitter
from ddtree.engine.scheduling.request import Req, SamplingParams

VOCAB = {0: "ab", 1: "):", 2: "cd", 3: "<eos>", 4: "xy"}
SPECIAL = {3}
EOS = 3


class FakeTokenizer:
    def __init__(self):
        self.calls = []

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False, **kw):
        self.calls.append(kw)
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))


def run(tokens, **params):
    emitter = TokenEmitter(FakeTokenizer(), (EOS,), max_context=100)
    req = Req(prompt_ids=[4], params=SamplingParams(max_tokens=50, **params))
    emitter.start(req)
    emitter.emit(req, tokens)
    if req.finish_reason is None:
        emitter.flush(req)
    return req


@pytest.mark.parametrize("stops", [(), ("zz",)])  # deferred detokenisation, then token by token
def test_a_stop_token_text_is_left_out_unless_asked(stops):
    req = run([0, 2, 4, 0], stop_token_ids=[4], stop=stops)
    assert req.finish_reason == "stop" and req.output_ids == [0, 2, 4]
    assert req.text == "abcd"
    kept = run([0, 2, 4, 0], stop_token_ids=[4], stop=stops, include_stop_str_in_output=True)
    assert kept.output_ids == [0, 2, 4] and kept.text == "abcdxy"


@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_eos_text_only_with_special_tokens_kept(stops):
    assert run([0, EOS, 2], stop=stops).text == "ab"
    kept = dict(include_stop_str_in_output=True, stop=stops)
    assert run([0, EOS, 2], **kept).text == "ab"  # special: skipped anyway
    shown = run([0, EOS, 2], skip_special_tokens=False, **kept)
    assert shown.text == "ab<eos>" and shown.output_ids == [0, EOS]
    # an ignored EOS is an ordinary token
    assert run([0, EOS, 2], ignore_eos=True, skip_special_tokens=False).text == "ab<eos>cd"


def test_a_stop_string_ends_the_text_before_it_or_after_it():
    """The stop completes inside a token ("):" for the stop ")"): the text is cut where the stop
    begins, or (include_stop_str_in_output) right after it, never after the token's tail; the
    matched string is the stop itself."""
    req = run([0, 1, 2], stop=[")"])
    assert req.text == "ab" and req.stop_hit == ")" and req.output_ids == [0, 1]
    kept = run([0, 1, 2], stop=[")"], include_stop_str_in_output=True)
    assert kept.text == "ab)" and kept.stop_hit == ")"


def test_spaces_between_special_tokens_reaches_the_tokenizer():
    emitter = TokenEmitter(FakeTokenizer(), (EOS,), max_context=100)
    for flag, want in ((True, {}), (False, {"spaces_between_special_tokens": False})):
        req = Req(prompt_ids=[4], params=SamplingParams(spaces_between_special_tokens=flag))
        emitter.start(req)
        emitter.emit(req, [0, 2])
        emitter.flush(req)
        assert req.text == "abcd" and emitter.tokenizer.calls[-1] == want
        emitter.drop(req.rid)


def test_stop_matcher_match_names_the_stop():
    m = StopMatcher(("):", ")", "cd"))
    assert m.match("ab):x", 3) == (2, "):")  # longest first at one index
    assert m.match("abcd", 2) == (2, "cd") and m.match("abxy", 2) is None
    assert m.find("ab):x", 3) == 2
