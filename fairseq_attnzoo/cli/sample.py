"""``attnzoo-sample``: continue a text prompt with a language-model checkpoint of any vocabulary.

Takes fairseq's own generation flags (``fairseq-interactive``'s parser: ``--path``, ``--beam``,
``--sampling``, ``--sampling-topk``, ``--sampling-topp``, ``--temperature``, ``--bpe``,
``--tokenizer``, ``--remove-bpe``, ``--cpu``, ``--seed``) and decodes with fairseq's
``SequenceGenerator`` and incremental decoding. The prompt is the forced prefix; ``--len`` tokens
follow it. Text goes through the same steps as ``fairseq-interactive``: tokenizer and BPE encode,
``Dictionary.encode_line``; then ``Dictionary.string`` (``--remove-bpe``), BPE and tokenizer
decode. Byte-level dictionaries (symbols ``0``..``255``, as ``scripts/data/prepare_enwik8.py``
writes them, newline = ``</s>``) are recognised and read and written as UTF-8 text.

    attnzoo-sample data/wiki-gensim/bin --path checkpoints/span/checkpoint_best.pt \\
        --prompt "The history of " --len 200 --sampling --sampling-topk 10
    attnzoo-sample data-bin/wikitext-103 --path checkpoints/pkm/checkpoint_best.pt \\
        --prompt "the history of" --len 50 --beam 4           # word-level, beam search
    attnzoo-sample DATA --path CKPT --bpe sentencepiece --sentencepiece-model spm.model \\
        --prompt "Die Geschichte" --len 40 --sampling          # sentencepiece pieces
    attnzoo-sample DATA --path CKPT --bpe subword_nmt --bpe-codes codes --remove-bpe \\
        --prompt "the history" --len 40 --sampling             # subword-nmt (@@ ) pieces

Translation checkpoints are refused in one line (``fairseq-interactive`` translates).
"""

import sys
from typing import List

import torch

from fairseq_attnzoo.cli import command

_NEWLINE = 10


def is_byte_dictionary(dictionary) -> bool:
    """True when every ordinary symbol is a byte value ``0``..``255`` (enwik8-style data)."""
    symbols = dictionary.symbols[dictionary.nspecial:]
    return bool(symbols) and all(s.isdigit() and int(s) < 256 for s in symbols
                                 if not s.startswith("madeupword"))


def encode_bytes(text: str, dictionary) -> torch.Tensor:
    """Bytes -> token ids ("116" -> id); the newline byte is </s>."""
    ids = [dictionary.eos() if b == _NEWLINE else dictionary.index(str(b))
           for b in text.encode("utf-8")]
    return torch.tensor(ids, dtype=torch.long)


def decode_bytes(ids, dictionary) -> str:
    out = bytearray()
    for i in ids:
        i = int(i)
        if i == dictionary.eos():
            out.append(_NEWLINE)
        elif i >= dictionary.nspecial:
            sym = dictionary[i]
            if sym.isdigit() and int(sym) < 256:
                out.append(int(sym))
    return out.decode("utf-8", errors="replace")


def build_parser():
    from fairseq import options

    parser = options.get_generation_parser(interactive=True)
    group = parser.add_argument_group("attnzoo-sample")
    group.add_argument("--prompt", default="The ", help="text the samples continue (default: "
                       "%(default)r)")
    group.add_argument("--len", type=int, default=200,
                       help="tokens generated after the prompt (bytes for byte-level data)")
    group.add_argument("--num", type=int, default=1, help="number of samples (default 1)")
    parser.set_defaults(beam=1, nbest=1, user_dir=None)
    return parser


def _fail(message: str):
    raise SystemExit(f"error: {message}")


@command
def main(argv: List[str] = None) -> int:
    from fairseq import checkpoint_utils, options, utils
    from fairseq.data import encoders
    from fairseq.models import FairseqEncoderDecoderModel
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_attnzoo.compat import bpe_name, sentencepiece_without_bpe

    args = options.parse_args_and_arch(build_parser(), argv)
    if args.path is None:
        _fail("--path CHECKPOINT is required")
    if args.len < 1 or args.num < 1:
        _fail(f"--len {args.len} and --num {args.num} must be positive")
    cfg = convert_namespace_to_omegaconf(args)
    utils.set_torch_seed(cfg.common.seed)
    try:
        models, _, task = checkpoint_utils.load_model_ensemble_and_task(
            [args.path], arg_overrides={"data": args.data})
    except (RuntimeError, FileNotFoundError) as e:  # e.g. the data dir of another dictionary
        from fairseq_attnzoo.messages.hints import (dictionary_mismatch, dictionary_mismatch_line,
                                                    hint_for)

        rows = dictionary_mismatch(str(e))
        line = (dictionary_mismatch_line(rows, args.data, args.path) if rows
                else hint_for(e, data=args.data))
        if line is None:
            raise
        _fail(line)
    if isinstance(models[0], FairseqEncoderDecoderModel):
        _fail(f"{args.path} is a translation model: attnzoo-sample continues language models; "
              "translate with fairseq-interactive")
    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    for m in models:
        m.eval()
        if use_cuda:
            m.cuda()
    d = task.target_dictionary
    byte_level = is_byte_dictionary(d)
    tokenizer = encoders.build_tokenizer(cfg.tokenizer)
    bpe = encoders.build_bpe(cfg.bpe)
    if byte_level and (tokenizer is not None or bpe is not None or cfg.common_eval.post_process):
        _fail("the dictionary is byte-level (symbols 0..255): drop --bpe/--tokenizer/--remove-bpe")
    if byte_level:
        prefix = encode_bytes(args.prompt, d)
    else:
        line = sentencepiece_without_bpe(d, bpe_name(cfg.bpe), [args.prompt])
        if line:
            _fail(line)
        text = args.prompt
        if tokenizer is not None:
            text = tokenizer.encode(text)
        if bpe is not None:
            text = bpe.encode(text)
        prefix = d.encode_line(text, add_if_not_exist=False, append_eos=False).long()
        known = prefix[prefix != d.unk()]
        if prefix.numel() and known.numel() == 0:
            _fail(f"none of the prompt's tokens is in the dictionary ({len(d):,} symbols, e.g. "
                  f"{' '.join(d.symbols[d.nspecial:d.nspecial + 5])}): pass the --bpe/--tokenizer "
                  "the data was made with (e.g. --bpe sentencepiece --sentencepiece-model M), "
                  "or write the prompt in the dictionary's tokens")
    if prefix.numel() == 0:
        _fail("--prompt must not be empty")
    prefix = prefix.unsqueeze(0).repeat(args.num, 1)
    total = prefix.size(1) + args.len  # the generator's lengths include the prefix
    cfg.generation.max_len_a, cfg.generation.max_len_b = 0, total
    cfg.generation.min_len = total
    generator = task.build_generator(models, cfg.generation)
    lengths = torch.full((args.num,), prefix.size(1))
    sample = {"net_input": {"src_tokens": prefix, "src_lengths": lengths}}
    if use_cuda:
        sample = utils.move_to_cuda(sample)
    hyps = task.inference_step(generator, models, sample, prefix_tokens=sample["net_input"]
                               ["src_tokens"])
    mode = "sampling" if cfg.generation.sampling else f"beam {cfg.generation.beam}"
    for i, h in enumerate(hyps):
        tokens = h[0]["tokens"].cpu()
        if byte_level:
            text = decode_bytes(tokens, d)
        else:
            text = d.string(tokens, cfg.common_eval.post_process)
            if bpe is not None:
                text = bpe.decode(text)
            if tokenizer is not None:
                text = tokenizer.decode(text)
        print(f"--- sample {i} ({mode}) ---")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
