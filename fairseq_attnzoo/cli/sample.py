#!/usr/bin/env python
"""Sample a continuation of a text prompt from a byte-level LM checkpoint (enwik8 format).

Uses fairseq's own ``SequenceGenerator`` (``task.build_generator``) with incremental decoding:
sampling (top-k / top-p / temperature) or beam search, both of which the adaptive-span and
All-Attention decoders support (``reorder_incremental_state``). The prompt's bytes are the
prefix; the newline byte is fairseq's ``</s>``, as in ``scripts/prepare_enwik8.py``.

    python scripts/sample_lm.py --path checkpoints/demo_span/checkpoint_best.pt \\
        --data data/wiki-gensim/bin --prompt "The history of " --len 200 --topk 10

(``fairseq-interactive`` works too with ``--task attnzoo_stream_lm``, but its input lines must be
space-separated byte values such as ``84 104 101``.)
"""

import argparse
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def encode(text: str, dictionary) -> torch.Tensor:
    """Bytes -> token ids ("116" -> id); the newline byte is </s>."""
    ids = [dictionary.eos() if b == 10 else dictionary.index(str(b)) for b in text.encode("utf-8")]
    return torch.tensor(ids, dtype=torch.long)


def decode(ids, dictionary) -> str:
    out = bytearray()
    for i in ids:
        i = int(i)
        if i == dictionary.eos():
            out.append(10)
        elif i >= dictionary.nspecial:
            sym = dictionary[i]
            if sym.isdigit() and int(sym) < 256:
                out.append(int(sym))
    return out.decode("utf-8", errors="replace")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="checkpoint")
    p.add_argument("--data", required=True, help="binarised data dir (for dict.txt)")
    p.add_argument("--prompt", default="The ")
    p.add_argument("--len", type=int, default=200, help="bytes to generate")
    p.add_argument("--beam", type=int, default=1, help="beam search instead of sampling if > 1")
    p.add_argument("--topk", type=int, default=-1, help="sample from the k most likely bytes")
    p.add_argument("--topp", type=float, default=-1.0, help="nucleus sampling")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num", type=int, default=1, help="number of samples")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args()

    sys.path.insert(0, REPO)
    import fairseq_attnzoo  # noqa: F401  (registers the models, task, criterion, optimizer)
    from argparse import Namespace

    from fairseq import checkpoint_utils, utils

    utils.set_torch_seed(a.seed)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [a.path], arg_overrides={"data": a.data})
    use_cuda = torch.cuda.is_available() and not a.cpu
    for m in models:
        m.eval()
        if use_cuda:
            m.cuda()
    d = task.source_dictionary
    prefix = encode(a.prompt, d).unsqueeze(0).repeat(a.num, 1)
    if prefix.size(1) == 0:
        raise SystemExit("--prompt must not be empty")
    sampling = a.beam <= 1
    total = prefix.size(1) + a.len  # the generator's lengths include the prefix
    gen_args = Namespace(beam=max(1, a.beam), nbest=1, max_len_a=0, max_len_b=total,
                         min_len=total, sampling=sampling, sampling_topk=a.topk,
                         sampling_topp=a.topp, temperature=a.temperature, unnormalized=False,
                         lenpen=1.0, unkpen=0.0, no_repeat_ngram_size=0, match_source_len=False,
                         diverse_beam_groups=-1, diverse_beam_strength=0.5, diversity_rate=-1.0,
                         constraints=None, prefix_allowed_tokens_fn=None, score_reference=False,
                         print_alignment=None, no_early_stop=False, eos_token=None,
                         iter_decode_max_iter=10, iter_decode_eos_penalty=0.0,
                         iter_decode_force_max_iter=False, iter_decode_with_beam=1,
                         iter_decode_with_external_reranker=False, retain_iter_history=False,
                         retain_dropout=False, retain_dropout_modules=None, decoding_format=None,
                         lm_path=None, lm_weight=0.0)
    generator = task.build_generator(models, gen_args)
    lengths = torch.full((a.num,), prefix.size(1))
    sample = {"net_input": {"src_tokens": prefix, "src_lengths": lengths}}
    if use_cuda:
        sample = utils.move_to_cuda(sample)
    with torch.no_grad():
        hyps = task.inference_step(generator, models, sample, prefix_tokens=sample["net_input"]
                                   ["src_tokens"])
    for i, h in enumerate(hyps):
        text = decode(h[0]["tokens"], d)
        print(f"--- sample {i} ({'beam ' + str(a.beam) if not sampling else 'sampling'}) ---")
        print(text)


if __name__ == "__main__":
    main()
