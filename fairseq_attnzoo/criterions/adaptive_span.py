"""``attnzoo_span_loss``: cross-entropy + the adaptive-span L1 penalty, reported in bits.

    loss = sum_t -log p(x_t | x_<t)  +  n_tokens * lambda * sum_layers mean_heads z

(fairseq divides gradients by the number of target tokens, so the penalty acts per token exactly as
in the reference, where it is added to the mean loss). Logged: ``loss`` = ``bpc`` = cross-entropy in
bits per target token (bits per character on byte-level data such as enwik8), ``ppl``,
``span_loss`` (the penalty term), ``span_avg`` / ``span_max`` (learned z over all heads, in
positions, ramp not included) and per layer ``span_avg_<i>`` / ``span_max_<i>``.

Works with any model that contains :class:`~fairseq_attnzoo.modules.adaptive_span.AdaptiveMask`
modules (and as plain cross-entropy with any other LM), with any task. The spans are kept in
[0, S] by the model after every update of fairseq's trainer (``UnitIntervalParameter``; under
``--fp16``/``--bf16`` on the fp32 master copies too), not by the criterion.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from omegaconf import II

from fairseq import utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass
from fairseq.logging import metrics

from .. import compat
from ..modules.adaptive_span import layer_spans, span_penalty


@dataclass
class SpanLossConfig(FairseqDataclass):
    sentence_avg: bool = II("optimization.sentence_avg")
    no_layer_spans: bool = field(
        default=False, metadata={"help": "do not log the average and maximum span of every layer "
                                 "(span_avg_<i>, span_max_<i>)"})


@register_criterion("attnzoo_span_loss", dataclass=SpanLossConfig)
class AdaptiveSpanLoss(FairseqCriterion):
    @compat.built_by_fairseq
    def __init__(self, task, sentence_avg: bool, no_layer_spans: bool = False):
        super().__init__(task)
        self.sentence_avg = sentence_avg
        self.log_layer_spans = not no_layer_spans

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = model.get_targets(sample, net_output)
        nll = F.nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1),
                         ignore_index=self.padding_idx, reduction="sum" if reduce else "none")
        # fairseq's convention: the batch's count of target tokens (no device -> host read)
        ntokens = sample.get("ntokens")
        if ntokens is None:
            ntokens = int(target.ne(self.padding_idx).sum())
        sample_size = sample["target"].size(0) if self.sentence_avg else ntokens
        penalty = span_penalty(model)
        loss = nll if penalty is None else nll + penalty * sample_size
        logging_output = {
            "loss": nll.data,
            "ntokens": ntokens,
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        # logged as tensors, read by fairseq's logging (once per update), not here (on a GPU
        # every read is a synchronisation)
        if penalty is not None:
            logging_output["span_loss"] = penalty.detach() * sample_size
        spans = layer_spans(model)
        if spans:  # logged as sums weighted by tokens so they survive summing over workers
            flat = torch.cat(spans)
            logging_output["span_avg"] = flat.mean() * ntokens
            logging_output["span_max"] = flat.max() * ntokens
            if self.log_layer_spans:
                for i, z in enumerate(spans):
                    logging_output[f"span_avg_{i}"] = z.mean() * ntokens
                    logging_output[f"span_max_{i}"] = z.max() * ntokens
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        total = lambda key: sum(log.get(key, 0) for log in logging_outputs)
        loss_sum, ntokens, sample_size = total("loss"), total("ntokens"), total("sample_size")
        ln2 = math.log(2)
        # bits per target token; sentence_avg changes only what the gradient is divided by
        metrics.log_scalar("loss", loss_sum / max(ntokens, 1) / ln2, ntokens, round=4)
        metrics.log_scalar("bpc", loss_sum / max(ntokens, 1) / ln2, ntokens, round=4)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["loss"].avg))
        if any("span_loss" in log for log in logging_outputs):
            metrics.log_scalar("span_loss", total("span_loss") / max(sample_size, 1) / ln2,
                               sample_size, round=5)
        keys = sorted({k for log in logging_outputs for k in log if k.startswith("span_")
                       and k != "span_loss"}, key=lambda k: (k.count("_"), len(k), k))
        for key in keys:
            metrics.log_scalar(key, total(key) / max(ntokens, 1), ntokens, round=1, priority=20)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
