"""The embedded reference pair: loads in transformers with our logits, and its drafter is really accepted."""

import os

import pytest
import torch

from ddtree.models.loader import load_drafter, load_target

ASSETS = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "ddtree", "assets", "default_pair"
)


def test_embedded_target_matches_transformers(one_torch_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(ASSETS, "target")
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.encode("def parse_args(argv):\n    parser = argparse.")])
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
        ours, _ = load_target(path, torch.float32).forward_train(ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_embedded_drafter_fits_its_target():
    target = load_target(os.path.join(ASSETS, "target"), torch.float32)
    drafter = load_drafter(os.path.join(ASSETS, "drafter"), torch.float32)
    assert (
        drafter.config.target_layer_ids
        and max(drafter.config.target_layer_ids) < target.config.num_hidden_layers
    )
    assert drafter.config.mask_token_id < target.config.vocab_size
    size = sum(
        os.path.getsize(os.path.join(ASSETS, d, "model.safetensors")) for d in ("target", "drafter")
    )
    assert size <= 48e6, f"the embedded pair must stay <= 48 MB, is {size / 1e6:.1f} MB"


@pytest.mark.parametrize("algorithm", ["DFLASH"])
def test_embedded_pair_is_accepted(algorithm, one_torch_thread):
    """The shipped drafter is really accepted on a held-out module's code (issue 3 measured tau 5.4 for DFLASH)."""
    from ddtree import LLM
    from ddtree.engine.scheduling.request import SamplingParams

    llm = LLM(None, speculative_algorithm=algorithm, max_running_requests=1)
    out = llm.generate(
        ["import json\n\n\ndef dumps(obj, *, indent=None):\n    "],
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    )[0]
    assert len(out.token_ids) == 48
    assert out.mean_accept_length > 2.5, out.mean_accept_length
