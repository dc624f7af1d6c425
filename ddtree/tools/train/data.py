"""Token datasets: a regular synthetic corpus for tiny targets, and text corpora tokenized with a `tokenizers`
byte-level BPE (e.g. the Python standard library) packed into fixed-length sequences.

Special-token layout shared by every tokenizer made here (ids 0..3, in this order):
  0 `<|bos|>` (also padding), 1 `<|endoftext|>` (eos), 2 `<|mask|>` (the DFlash drafter's MASK row),
  3 `<|unk|>`. Reserving the mask id inside the target vocabulary keeps it a physical embedding row.
"""

from __future__ import annotations

import json
import os

import torch

from ddtree.bench.corpus import read_texts, stdlib_files  # noqa: F401 - re-exported
from ddtree.models.shapes import BOS_ID, EOS_ID, MASK_ID  # noqa: F401 - the reserved ids, re-exported

SPECIAL_TOKENS = ("<|bos|>", "<|endoftext|>", "<|mask|>", "<|unk|>")
UNK_ID = 3  # after shapes.BOS_ID, EOS_ID, MASK_ID = 0, 1, 2
NUM_SPECIAL = len(SPECIAL_TOKENS)
# the "language" (the fixed successor permutation) must not depend on the corpus seed
_LANGUAGE_SEED = 0x5EED


def successor_table(vocab: int) -> torch.Tensor:
    """The fixed permutation of regular tokens used by `chain` segments: next = table[cur]."""
    g = torch.Generator().manual_seed(_LANGUAGE_SEED + vocab)
    regular = vocab - NUM_SPECIAL
    table = torch.arange(vocab)
    table[NUM_SPECIAL:] = NUM_SPECIAL + torch.randperm(regular, generator=g)
    return table


def synthetic_sequences(
    n: int,
    length: int,
    vocab: int = 64,
    seed: int = 0,
    noise: float = 0.03,
    segment: tuple[int, int] = (16, 32),
    max_stride: int = 3,
) -> torch.LongTensor:
    """[n, length] sequences `<|bos|>` + segments of three regular kinds over tokens 4..vocab-1:
    arithmetic progressions mod the regular range (stride +-1..max_stride, fixed per sequence),
    repeated motifs of 2-5 tokens,
    and walks of the fixed successor permutation. Segment boundaries are random and a fraction `noise` of
    positions is replaced by a random token (the underlying pattern carries on past it), so a model learns
    the structure quickly but cannot predict every token."""
    if vocab <= NUM_SPECIAL + 8:
        raise ValueError(f"vocab {vocab} too small for the synthetic corpus")
    g = torch.Generator().manual_seed(seed)
    regular = vocab - NUM_SPECIAL
    succ = successor_table(vocab)

    def rint(lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = torch.empty(n, length, dtype=torch.long)
    for row in range(n):
        stride = rint(1, max_stride) * (1 if rint(0, 1) else -1)
        seq = [BOS_ID]
        while len(seq) < length:
            seg_len = rint(*segment)
            kind = rint(0, 2)
            if kind == 0:
                start = rint(0, regular - 1)
                seq += [NUM_SPECIAL + (start + i * stride) % regular for i in range(seg_len)]
            elif kind == 1:
                motif = [NUM_SPECIAL + rint(0, regular - 1) for _ in range(rint(2, 5))]
                seq += [motif[i % len(motif)] for i in range(seg_len)]
            else:
                tok = NUM_SPECIAL + rint(0, regular - 1)
                for _ in range(seg_len):
                    seq.append(tok)
                    tok = int(succ[tok])
        out[row] = torch.tensor(seq[:length])
    flip = torch.rand(n, length, generator=g) < noise
    flip[:, 0] = False
    out[flip] = torch.randint(NUM_SPECIAL, vocab, (int(flip.sum()),), generator=g)
    return out


# ---------------------------------------------------------------- tokenizers


def _save_fast_tokenizer(tok, out_dir: str, chat_template: str | None = None):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[BOS_ID],
        mask_token=SPECIAL_TOKENS[MASK_ID],
        unk_token=SPECIAL_TOKENS[UNK_ID],
    )
    if chat_template:
        fast.chat_template = chat_template
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


# Prompts are plain text: each message's content, then nothing else (the corpora have no chat turns).
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"
)


def word_tokenizer(vocab: int, out_dir: str | None = None):
    """WordLevel tokenizer for the synthetic corpus: regular token i is the word str(i), so ids read as
    numbers ("12 15 18"); encoding prepends `<|bos|>` like the training data; decode joins with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    words.update({str(i): i for i in range(NUM_SPECIAL, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[BOS_ID]} $A", special_tokens=[(SPECIAL_TOKENS[BOS_ID], BOS_ID)]
    )
    if out_dir is None:
        return tok
    return _save_fast_tokenizer(tok, out_dir, PLAIN_CHAT_TEMPLATE)


def train_bpe_tokenizer(files: list[str], vocab_size: int, out_dir: str, min_frequency: int = 2):
    """Byte-level BPE over `files` with SPECIAL_TOKENS at ids 0..3; saved as tokenizer.json +
    tokenizer_config.json so `AutoTokenizer.from_pretrained(out_dir)` loads it offline. Returns the
    `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, "special tokens must keep ids 0..3"
    return _save_fast_tokenizer(tok, out_dir, PLAIN_CHAT_TEMPLATE)


def tokenize_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids per text without special tokens (accepts a `tokenizers.Tokenizer` or a HF fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


def pack_documents(
    docs: list[list[int]], length: int, bos: int = BOS_ID, eos: int = EOS_ID
) -> torch.LongTensor:
    """Concatenate `bos + doc + eos` for every doc and cut the stream into [N, length] rows (remainder dropped)."""
    stream: list[int] = []
    for d in docs:
        stream.append(bos)
        stream.extend(d)
        stream.append(eos)
    n = len(stream) // length
    return torch.tensor(stream[: n * length], dtype=torch.long).view(n, length)


# ---------------------------------------------------------------- token files


def save_tokens(path: str, input_ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(
        {"input_ids": input_ids.cpu(), "loss_mask": None if loss_mask is None else loss_mask.cpu()},
        path,
    )


def load_tokens(path: str, tokenizer=None, add_bos: bool = True):
    """Read a token file: `.pt` (a LongTensor or {"input_ids", "loss_mask"}) -> (ids [N, T], mask or None);
    `.jsonl` -> list of prompt id lists, one per line ({"input_ids": [...]}, {"prompt": text} or {"text": text};
    text needs `tokenizer`)."""
    if path.endswith(".jsonl"):
        prompts = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if "input_ids" in rec:
                    prompts.append([int(t) for t in rec["input_ids"]])
                    continue
                if tokenizer is None:
                    raise ValueError(f"{path}: text prompts need a tokenizer")
                text = rec.get("prompt", rec.get("text"))
                ids = tokenize_texts(tokenizer, [text])[0]
                prompts.append(([BOS_ID] if add_bos else []) + ids)
        return prompts
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, torch.Tensor):
        return obj.long(), None
    return obj["input_ids"].long(), obj.get("loss_mask")


def right_pad(
    seqs: list[list[int]], pad: int = BOS_ID
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Left-align variable-length sequences into [N, max_len]; returns (ids, real-token mask)."""
    width = max(len(p) for p in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, p in enumerate(seqs):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        mask[i, : len(p)] = True
    return ids, mask
