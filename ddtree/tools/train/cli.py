"""`ddtree train-target` and `ddtree train-drafter`: one seeded command each (the console script dispatches
`main(argv)` with the subcommand name first)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _common(p: argparse.ArgumentParser, steps: int, lr: float, batch: int) -> None:
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--batch-size", type=int, default=batch)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--autocast-dtype", default="auto", help="auto = bfloat16 on CUDA, fp32 on CPU")
    p.add_argument("--save-dtype", default="float32", help="dtype of the exported weights")
    p.add_argument(
        "--save-every",
        type=int,
        default=500,
        help="checkpoint period in steps (0: only at the end)",
    )
    p.add_argument("--no-resume", dest="resume", action="store_false", help="ignore OUT/checkpoint")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--out", required=True, help="output model directory")


def _dtype(name: str):
    from ddtree.models.layers import torch_dtype

    return None if name == "auto" else torch_dtype(name)


# flags every training loop here takes under its own name
_LOOP_FLAGS = ("steps", "lr", "batch_size", "seed", "device", "progress")


def _loop_args(args, history: list) -> dict:
    """The options every training loop here takes from its command line the same way."""
    named = {flag: getattr(args, flag) for flag in _LOOP_FLAGS}
    return named | {
        "autocast_dtype": _dtype(args.autocast_dtype),
        "out_dir": args.out,
        "history": history,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="ddtree")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train-target",
        allow_abbrev=False,
        help="pretrain a small Qwen3 target from scratch (HF format out)",
    )
    t.add_argument(
        "--corpus",
        nargs="+",
        default=["synthetic"],
        help="'synthetic', 'stdlib' (Python standard library .py files) or text files",
    )
    t.add_argument(
        "--holdout",
        default="json,argparse,textwrap,statistics",
        help="stdlib modules kept for eval",
    )
    t.add_argument(
        "--vocab-size", type=int, default=None, help="synthetic vocab (64) or BPE vocab (4096)"
    )
    t.add_argument("--num-sequences", type=int, default=8192, help="synthetic corpus size")
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--hidden-size", type=int, default=256)
    t.add_argument("--num-layers", type=int, default=4)
    t.add_argument("--num-heads", type=int, default=4)
    t.add_argument("--num-kv-heads", type=int, default=2)
    t.add_argument("--head-dim", type=int, default=64)
    t.add_argument("--intermediate-size", type=int, default=None, help="default 3 x hidden")
    t.add_argument("--max-position-embeddings", type=int, default=4096)
    t.add_argument("--rope-theta", type=float, default=10000.0)
    t.add_argument("--tie-word-embeddings", action="store_true")
    t.add_argument("--warmup", type=float, default=0.04, help="ratio (< 1) or steps")
    t.add_argument("--weight-decay", type=float, default=0.1)
    _common(t, steps=2000, lr=3e-3, batch=32)

    d = sub.add_parser(
        "train-drafter",
        allow_abbrev=False,
        help="train a DFlash or DFlash2 drafter for a target (z-lab format out)",
    )
    d.add_argument("--model-path", required=True, help="target model directory")
    d.add_argument(
        "--data",
        default=None,
        help="token file (.pt: ids [N,T] or {input_ids, loss_mask}) or "
        ".jsonl prompts ({'prompt'|'text': str} or {'input_ids': [...]})",
    )
    d.add_argument(
        "--regenerate",
        type=int,
        default=0,
        metavar="N",
        help="regenerate N training samples with the target from the --data prompts",
    )
    d.add_argument(
        "--prompt-len",
        type=int,
        default=32,
        help="prompt prefix taken from .pt rows when regenerating",
    )
    d.add_argument(
        "--gen-len", type=int, default=224, help="tokens generated per regenerated sample"
    )
    d.add_argument(
        "--temperature", type=float, default=0.0, help="regeneration temperature (0 = greedy)"
    )
    d.add_argument("--num-layers", type=int, default=5)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--target-layer-ids", default=None, help="comma list; default z-lab spacing")
    d.add_argument("--mask-token-id", type=int, default=None)
    d.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    d.add_argument(
        "--gamma", type=float, default=None, help="loss decay; default 7 (B=16), 4 (B=8)"
    )
    d.add_argument(
        "--kd", action="store_true", help="distil the target's distributions instead of CE"
    )
    d.add_argument(
        "--eval-frac", type=float, default=0.02, help="held-out fraction for block acceptance"
    )
    d.add_argument("--eval-every", type=int, default=0)
    d.add_argument(
        "--architecture",
        choices=("dflash", "dflash2"),
        default="dflash",
        help="dflash2: DFlash2DraftModel (grouped dynamic convolutions + candidate selector, "
        "trained with the selector's loss added)",
    )
    d.add_argument("--selector-rank", type=int, default=256, help="dflash2: selector rank r")
    d.add_argument("--selector-top-k", type=int, default=16, help="dflash2: candidates rescored")
    d.add_argument("--conv-kernel-size", type=int, default=2, help="dflash2: convolution taps")
    d.add_argument("--conv-group-size", type=int, default=16, help="dflash2: channels per group")
    d.add_argument(
        "--selector-alpha", type=float, default=1.0, help="dflash2: weight of the selector loss"
    )
    d.add_argument(
        "--init-from",
        default=None,
        metavar="DFLASH_DIR",
        help="dflash2: start from this DFlash drafter of the same geometry (its function exactly)",
    )
    d.add_argument(
        "--selector-only",
        action="store_true",
        help="dflash2 with --init-from: train only the selector, on features computed once "
        "(backbone frozen, convolutions at the identity; --batch-size counts positions)",
    )
    _common(d, steps=2000, lr=6e-4, batch=4)
    return parser


def _target_corpus(args):
    from ddtree.tools.train import data

    if args.corpus == ["synthetic"]:
        vocab = args.vocab_size or 64
        data.word_tokenizer(vocab, args.out)
        train = data.synthetic_sequences(args.num_sequences, args.seq_len, vocab, args.seed)
        held = data.synthetic_sequences(
            max(8, args.num_sequences // 50), args.seq_len, vocab, args.seed + 1
        )
        return vocab, train, held
    if args.corpus == ["stdlib"]:
        files, held_files = data.stdlib_files(tuple(args.holdout.split(",")))
    else:
        files, held_files = list(args.corpus), []
    tok = data.train_bpe_tokenizer(files, args.vocab_size or 4096, args.out)
    train = data.pack_documents(data.tokenize_texts(tok, data.read_texts(files)), args.seq_len)
    if held_files:
        held = data.pack_documents(
            data.tokenize_texts(tok, data.read_texts(held_files)), args.seq_len
        )
    else:
        n = max(1, train.shape[0] // 50)
        train, held = train[:-n], train[-n:]
    # pad the embedding like Qwen does; extra rows are never targets
    vocab = -(-len(tok) // 64) * 64
    return vocab, train, held


def train_target_cmd(args) -> int:
    from ddtree.tools.train.lm import qwen3_config, train_lm

    os.makedirs(args.out, exist_ok=True)
    vocab, train, held = _target_corpus(args)
    from ddtree.tools.train.data import save_tokens

    # the packed corpus doubles as the prompt source for `train-drafter --data OUT/tokens/train.pt`
    save_tokens(os.path.join(args.out, "tokens", "train.pt"), train.to(torch.int32))
    save_tokens(os.path.join(args.out, "tokens", "heldout.pt"), held.to(torch.int32))
    print(
        f"corpus: {tuple(train.shape)} train, {tuple(held.shape)} held-out tokens; vocab {vocab}",
        file=sys.stderr,
    )
    cfg = qwen3_config(
        vocab,
        args.hidden_size,
        args.num_layers,
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        args.intermediate_size,
        args.max_position_embeddings,
        args.rope_theta,
        args.tie_word_embeddings,
        torch_dtype=args.save_dtype,
    )
    history: list = []
    train_lm(
        cfg,
        train,
        **_loop_args(args, history),
        warmup=args.warmup if args.warmup < 1 else int(args.warmup),
        weight_decay=args.weight_decay,
        save_every=args.save_every,
        resume=args.resume,
        save_dtype=_dtype(args.save_dtype),
        eval_sequences=held[:64],
        threads=args.threads,
    )
    _write_metrics(args.out, history)
    return 0


def _write_metrics(out: str, history: list) -> None:
    last = [h for h in history if "loss" in h][-20:]
    summary = {"final_loss": sum(h["loss"] for h in last) / max(1, len(last))}
    summary.update(
        {
            k: v
            for h in history
            for k, v in h.items()
            if k in ("eval_loss", "tau", "tau_init", "best_step", "best_val_chain_tau")
        }
    )
    with open(os.path.join(out, "train_metrics.json"), "w", encoding="utf-8") as f:
        json.dump({"summary": summary, "history": history}, f)
    print(json.dumps(summary), file=sys.stderr)


def _drafter_data(args, target, tokenizer):
    from ddtree.tools.train.data import load_tokens, right_pad, save_tokens
    from ddtree.tools.train.lm import generate

    regen_path = os.path.join(args.out, "regenerated.pt")
    if args.regenerate and args.resume and os.path.exists(regen_path):
        return load_tokens(regen_path)  # a resumed run must see the same samples
    if args.data is None:
        raise SystemExit("train-drafter: --data is required (token file or JSONL prompts)")
    loaded = load_tokens(args.data, tokenizer)
    if not args.regenerate:
        if isinstance(loaded, list):
            raise SystemExit("train-drafter: JSONL prompts need --regenerate N")
        return loaded
    prompts = loaded if isinstance(loaded, list) else loaded[0][:, : args.prompt_len].tolist()
    prompts = [prompts[i % len(prompts)] for i in range(args.regenerate)]
    seqs = generate(
        target, prompts, args.gen_len, args.temperature, seed=args.seed, device=args.device
    )
    ids, mask = right_pad(seqs)
    for i, p in enumerate(prompts):
        mask[i, : len(p)] = (
            False  # prompts are context only; anchors and labels live in the response
        )
    save_tokens(regen_path, ids, mask)
    return ids, mask


def train_drafter_cmd(args) -> int:
    from ddtree.models.configs import TargetConfig
    from ddtree.models.loader import load_target
    from ddtree.tools.train.drafter import drafter_config_for, train_drafter

    os.makedirs(args.out, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = None
    if os.path.exists(os.path.join(args.model_path, "tokenizer.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    tcfg = TargetConfig.from_path(args.model_path)
    target = load_target(
        args.model_path,
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32,
        args.device,
    )
    mask_id = args.mask_token_id
    if mask_id is None and tokenizer is not None and tokenizer.mask_token_id is not None:
        mask_id = tokenizer.mask_token_id
    ids_arg = (
        tuple(int(i) for i in args.target_layer_ids.split(",")) if args.target_layer_ids else None
    )
    save_dtype = _dtype(args.save_dtype)
    dflash2 = {}
    if args.architecture == "dflash2":
        dflash2 = dict(
            architecture="DFlash2DraftModel",
            selector_rank=args.selector_rank,
            selector_top_k=args.selector_top_k,
            conv_kernel_size=args.conv_kernel_size,
            conv_group_size=args.conv_group_size,
        )
    elif args.init_from or args.selector_only:
        raise SystemExit("train-drafter: --init-from / --selector-only need --architecture dflash2")
    if args.selector_only and not args.init_from:
        raise SystemExit("train-drafter: --selector-only needs --init-from DFLASH_DIR")
    dcfg = drafter_config_for(
        tcfg,
        args.num_layers,
        args.block_size,
        mask_id,
        ids_arg,
        torch_dtype=args.save_dtype,
        **dflash2,
    )
    ids, mask = _drafter_data(args, target, tokenizer)
    n_eval = max(1, int(ids.shape[0] * args.eval_frac)) if ids.shape[0] > 1 else 0
    train = (ids[:-n_eval], None if mask is None else mask[:-n_eval]) if n_eval else (ids, mask)
    held = (ids[-n_eval:], None if mask is None else mask[-n_eval:]) if n_eval else None
    print(
        f"drafter data: {tuple(ids.shape)} ({n_eval} held out); taps "
        f"{dcfg['dflash_config']['target_layer_ids']}, mask id {dcfg['dflash_config']['mask_token_id']}",
        file=sys.stderr,
    )
    history: list = []
    if args.selector_only:
        from ddtree.tools.train.selector_fit import train_selector_only

        train_selector_only(
            target,
            dcfg,
            train,
            args.init_from,
            **_loop_args(args, history),
            anchors_per_seq=args.anchors,
            gamma=args.gamma,
            save_dtype=save_dtype,
            eval_sequences=held,
            features=os.path.join(args.out, "selector_features"),
        )
        _write_metrics(args.out, history)
        return 0
    train_drafter(
        target,
        dcfg,
        train,
        **_loop_args(args, history),
        anchors_per_seq=args.anchors,
        gamma=args.gamma,
        kd=args.kd,
        save_every=args.save_every,
        resume=args.resume,
        save_dtype=save_dtype,
        eval_sequences=held,
        eval_every=args.eval_every,
        threads=args.threads,
        selector_alpha=args.selector_alpha,
        init_from=args.init_from,
    )
    _write_metrics(args.out, history)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train-target":
        return train_target_cmd(args)
    return train_drafter_cmd(args)


if __name__ == "__main__":
    raise SystemExit(main())
