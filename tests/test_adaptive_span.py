"""Adaptive attention span and All-Attention (persistent memory): method-specific properties.

The generic sweep (test_sweep.py) covers build / forward-backward / incremental == full / CLI for
every arch; here: the math against explicit computations, trimming, clamping, padding, the stream
cache, the task's layout, the criterion's bits and the optimizer."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from fairseq_attnzoo.modules.adaptive_span import (
    AdaptiveSpanAttention,
    clamp_spans,
    layer_spans,
    skew,
    span_penalty,
    unskew,
)
from fairseq_attnzoo.optim.adagrad_clip import AdagradClip
from fairseq_attnzoo.tasks.stream_lm import StreamBatches
from zoo_testlib import build, decode_steps


#: where the fused band attention is compared with the explicit path (``ATTNZOO_TEST_DEVICE=cuda``:
#: torch's memory-efficient CUDA kernel; on the CPU, SDPA's CPU path)
DEVICE = torch.device(os.environ.get("ATTNZOO_TEST_DEVICE", "cpu"))


def _attn(dim=16, heads=2, span=12, ramp=4, init=0.0, **kw):
    torch.manual_seed(0)
    att = AdaptiveSpanAttention(dim, heads, span, ramp=ramp, span_init=init, own_key_pe=True, **kw)
    return att.eval()


def _explicit(att, x, memory=None, renorm=True):
    """Reference computation, one query and one key at a time: logits q.(k + p_d)/sqrt(d_h) for
    distances d < S (keys before the stream start do not exist), softmax, times the soft mask m(d),
    renormalised (reference formulation; fairseq's port: not), plus persistent slots in the same
    softmax."""
    h = x if memory is None else torch.cat([memory, x], 1)
    b, t_all, _ = h.shape
    t0 = t_all - x.size(1)
    heads, dh, s = att.num_heads, att.head_dim, att.max_span
    q = att.split_heads(att.q_proj(x)) / math.sqrt(dh)
    k, v = att.split_heads(att.k_proj(h)), att.split_heads(att.v_proj(h))
    z = att.mask.span.detach() * s
    r = att.mask.ramp
    out = torch.zeros(b, heads, x.size(1), dh)
    for i in range(x.size(1)):
        pos = t0 + i
        js = list(range(max(0, pos - s + 1), pos + 1))
        d = torch.tensor([pos - j for j in js], dtype=torch.float)
        pe = att.key_pe[0][:, [s - 1 - int(dd) for dd in d]]  # [dh, n]
        for hh in range(heads):
            logits = torch.einsum("bd,bnd->bn", q[:, hh, i], k[:, hh, js] + pe.t())
            m = ((r + z[hh] - d) / r).clamp(0, 1)  # m_z(x) = clamp((R + z - x) / R, 0, 1)
            vals = v[:, hh, js]
            if att.persistent is not None:
                logits = torch.cat([logits, q[:, hh, i] @ att.persistent.keys()[hh]], -1)
                m = torch.cat([m, torch.ones(att.persistent.num_slots)])
                vals = torch.cat([vals, att.persistent.values()[hh].expand(b, -1, -1)], 1)
            p = torch.softmax(logits, -1) * m
            if renorm:
                p = p / p.sum(-1, keepdim=True)
            out[:, hh, i] = torch.einsum("bn,bnd->bd", p, vals)
    return att.out_proj(out.transpose(1, 2).reshape(b, x.size(1), heads * dh))


def test_skew_unskew_are_inverse():
    x = torch.randn(2, 3, 5, 4)  # M = 5, span 4
    y = skew(x)
    assert y.shape == (2, 3, 5, 8)
    assert torch.equal(unskew(y, 4), x)
    i, j = 3, 2
    assert torch.equal(y[..., i, i + j], x[..., i, j])
    assert y[..., 0, 4:].abs().sum() == 0 and y[..., 4, :4].abs().sum() == 0  # off the band


def test_full_span_equals_plain_causal_attention():
    """z = S (mask 1 everywhere in the window) and S >= T: plain causal softmax attention with
    explicit relative-position logits."""
    att = _attn(span=16, init=1.0)
    x = torch.randn(2, 10, 16)
    out, _ = att(x)
    dh = att.head_dim
    q = att.split_heads(att.q_proj(x)) / math.sqrt(dh)
    k, v = att.split_heads(att.k_proj(x)), att.split_heads(att.v_proj(x))
    idx = torch.arange(10)
    dist = idx.view(-1, 1) - idx.view(1, -1)  # i - j
    pe = att.key_pe[0][:, (15 - dist).clamp(0, 15)]  # [dh, T, T]
    logits = q @ k.transpose(-1, -2) + torch.einsum("bhid,dij->bhij", q, pe)
    logits = logits.masked_fill(dist < 0, float("-inf"))
    ref = torch.softmax(logits, -1) @ v
    ref = att.out_proj(ref.transpose(1, 2).reshape(2, 10, 16))
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("init,persistent,renorm", [(0.3, 0, True), (0.05, 0, True),
                                                    (0.3, 5, True), (0.3, 5, False)])
def test_soft_mask_window_and_cache_match_explicit(init, persistent, renorm):
    """Learned spans inside the ramp, a window S smaller than the context, a cache of previous
    hidden states and (All-Attention) persistent slots in the same softmax; renorm=False is
    fairseq's examples/adaptive_span port (untrimmed here: trim_chunk 0)."""
    att = _attn(span=12, ramp=4, init=init, persistent_slots=persistent, renorm=renorm)
    att.mask.trim_chunk = 0 if not renorm else att.mask.trim_chunk
    with torch.no_grad():
        att.mask.span.copy_(torch.tensor([init, init / 2]))
    x, mem = torch.randn(2, 7, 16), torch.randn(2, 9, 16)
    out, _ = att(x, memory=mem)
    assert (out - _explicit(att, x, mem, renorm)).abs().max() < 1e-5


def _band_run(att, kernel, dtype, x, memory, kpm, weights):
    """Output and every gradient (input, parameters) of ``att`` run with ``kernel``, in float64."""
    att = att.to(DEVICE, dtype)
    att.kernel = kernel
    att.zero_grad()
    x = x.to(DEVICE, dtype, copy=True).requires_grad_(True)
    out, _ = att(x, memory=None if memory is None else memory.to(DEVICE, dtype),
                 key_padding_mask=None if kpm is None else kpm.to(DEVICE))
    (out.double() * weights.to(DEVICE)).sum().backward()
    return [out.detach().double().cpu(), x.grad.double().cpu()] + [
        p.grad.double().cpu() for p in att.parameters() if p.grad is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "padded", "memory", "exclude_self", "dynamic"])
def test_sdpa_band_equals_explicit(dtype, case):
    """The fused path (``kernel="sdpa"``: position logits + log-mask as an additive bias of torch's
    scaled_dot_product_attention, query chunks as batch entries) computes the explicit path's
    output and gradients: equal in float32, and in float16/bfloat16 as close to the float32
    result as the explicit path itself is."""
    torch.manual_seed(0)
    att = AdaptiveSpanAttention(32, 4, 96, ramp=8, span_init=0.3, own_key_pe=True, query_chunk=16,
                                trim_chunk=16, dynamic=case == "dynamic",
                                exclude_self=case == "exclude_self")
    x = torch.randn(3, 64, 32)
    memory = torch.randn(3, 40, 32) if case in ("memory", "padded") else None
    kpm = None
    if case == "padded":  # a left-padded stream start, a padded tail, padding in the cache
        kpm = torch.zeros(3, 104, dtype=torch.bool)
        kpm[0, :50], kpm[1, -7:], kpm[2, 10:20] = True, True, True
    z = att.mask.spans(x)
    assert att.chunk_size(64, att.mask.window(z)) < 64  # several query chunks
    weights = torch.randn(3, 64, 32, dtype=torch.float64)
    # A padded query's output is unspecified, as in fairseq's attention: the criterion ignores
    # its (pad) target. Its keys may all be masked; there CUDA's fused kernels return 0 and the
    # explicit softmax a uniform average (seen on an H100), so those rows weigh 0 and are not
    # compared, as in training.
    qpad = torch.zeros(3, 64, dtype=torch.bool) if kpm is None else kpm[:, -64:]
    weights[qpad] = 0
    ref = _band_run(att, "explicit", torch.float32, x, memory, kpm, weights)
    fused = _band_run(att, "sdpa", dtype, x, memory, kpm, weights)
    explicit = _band_run(att, "explicit", dtype, x, memory, kpm, weights)
    assert len(fused) == len(ref) >= 8  # out, x, q/k/v/out projections, key_pe, span
    ref[0], fused[0], explicit[0] = (t[~qpad] for t in (ref[0], fused[0], explicit[0]))
    for r, f, e in zip(ref, fused, explicit):
        scale = r.abs().max().item()
        if dtype == torch.float32:
            assert (f - r).abs().max().item() <= 1e-5 * scale
        else:
            assert (f - r).abs().max().item() <= 2 * (e - r).abs().max().item() + 1e-3 * scale


def test_sdpa_kernel_choice_and_errors():
    att = _attn()
    assert not att.uses_sdpa(torch.zeros(1))  # auto: the explicit path off CUDA
    att.kernel = "sdpa"
    assert att.uses_sdpa(torch.zeros(1))
    assert "kernel=sdpa" in repr(att)
    # the module names its arguments; the model its flags (test_sdpa_kernel_flag_refusals)
    with pytest.raises(ValueError, match="kernel='sdpa' needs .* persistent_slots=0"):
        _attn(persistent_slots=2, kernel="sdpa")
    with pytest.raises(ValueError, match=r"kernel='sdpa' needs .*\(renorm=True"):
        _attn(renorm=False, kernel="sdpa")
    with pytest.raises(ValueError, match="must be one of auto, sdpa, explicit"):
        _attn(kernel="flash")


def test_trimmed_equals_untrimmed_and_trims():
    torch.manual_seed(0)
    att = AdaptiveSpanAttention(32, 4, max_span=512, ramp=32, span_init=0.05, own_key_pe=True)
    x = torch.randn(2, 128, 32, requires_grad=True)
    mem = torch.randn(2, 300, 32)
    results = []
    for trim, chunk in ((64, 64), (64, 0), (0, 0)):
        att.mask.trim_chunk, att.query_chunk = trim, chunk
        att.zero_grad()
        x.grad = None
        out, _ = att(x, memory=mem)
        out.square().sum().backward()
        results.append((out.detach(), x.grad.clone(), att.mask.span.grad.clone(),
                        att.k_proj.weight.grad.clone()))
    # z = 0.05 * 512 = 25.6 -> needed ceil(25.6 + 32) = 58 -> window 64 of 512
    assert att.mask.window(att.mask.spans()) == 512  # trimming off
    att.mask.trim_chunk, att.query_chunk = 64, 64
    assert att.mask.window(att.mask.spans()) == 64
    assert att.chunk_size(128, 64) == 64  # queries chunked too
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert (a - b).abs().max() <= 1e-5 * max(1.0, a.abs().max().item())


def test_spans_clamped_after_optimizer_step(lm_data):
    args, task, model, criterion = build(
        "adaptive_span_lm_small", lm_data,
        ["--optimizer", "adagrad_clip", "--lr", "0.07", "--grad-clip-per-tensor", "0.03"])
    from fairseq import optim

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optim.build_optimizer(args, params)
    spans = [m.span for m in model.modules() if type(m).__name__ == "AdaptiveMask"]
    with torch.no_grad():
        spans[0].fill_(1.5)
        spans[1].fill_(-0.2)
    model.train()
    sample = next(iter(task.get_batch_iterator(task.dataset("train") if "train" in task.datasets
                                               else _load(task, "train"), max_sentences=4)
                       .next_epoch_itr(shuffle=False)))
    loss, _, _ = criterion(model, sample)
    loss.backward()
    task.optimizer_step(optimizer, model, 0)
    model.perform_slowmo(optimizer.optimizer)  # fairseq's trainer, after every update: projects
    assert all(float(s.min()) >= 0 and float(s.max()) <= 1 for s in spans)
    assert float(spans[0].max()) == 1.0 and float(spans[1].min()) == 0.0
    assert clamp_spans(model) == 2
    # fp16/bf16 master copies (fairseq's FP16Optimizer): tests/test_precision.py


def _load(task, split):
    task.load_dataset(split)
    return task.dataset(split)


@pytest.mark.parametrize("flags", [["--persistent-memory-size", "2"],
                                   ["--adaptive-span-no-renorm"]])
def test_sdpa_kernel_flag_refusals(lm_data, flags):
    with pytest.raises(ValueError, match="--adaptive-span-kernel sdpa needs .* drop "
                       "--adaptive-span-no-renorm / --persistent-memory-size") as err:
        _lm(lm_data, extra=["--adaptive-span-kernel", "sdpa"] + flags)
    assert "\n" not in str(err.value)


def _lm(lm_data, arch="adaptive_span_lm_small", extra=()):
    args, task, model, criterion = build(arch, lm_data, ["--dropout", "0"] + list(extra))
    # spans spread over the ramp so that the soft mask matters
    with torch.no_grad():
        for i, m in enumerate(m for m in model.modules() if type(m).__name__ == "AdaptiveMask"):
            if m.span is not None:
                m.span.copy_(torch.linspace(0.05, 0.6, m.span.numel()) + 0.1 * i)
    return args, task, model.eval(), criterion


@pytest.mark.parametrize("arch,extra", [("adaptive_span_lm_small", []),
                                        ("adaptive_span_lm_small", ["--adaptive-span-kernel", "sdpa"]),
                                        ("all_attention_lm", [])])
def test_padding_does_not_change_outputs(lm_data, arch, extra):
    _, task, model, _ = _lm(lm_data, arch, extra)
    d = task.source_dictionary
    torch.manual_seed(1)
    seqs = [torch.randint(d.nspecial, len(d), (n,)) for n in (20, 13, 6)]
    with torch.no_grad():
        alone = [model(s.unsqueeze(0))[0][0] for s in seqs]
        for left in (False, True):
            batch = torch.full((3, 20), d.pad())
            for r, s in enumerate(seqs):
                if left:
                    batch[r, 20 - len(s):] = s
                else:
                    batch[r, :len(s)] = s
            out = model(batch)[0]
            for r, s in enumerate(seqs):
                got = out[r, 20 - len(s):] if left else out[r, :len(s)]
                assert (got - alone[r]).abs().max() < 1e-5, (left, r)


@pytest.mark.parametrize("arch,extra", [("adaptive_span_lm_small", []),
                                        ("adaptive_span_lm_small", ["--adaptive-span-dynamic"]),
                                        ("adaptive_span_lm_small", ["--adaptive-span-dynamic",
                                                                    "--adaptive-span-kernel", "sdpa"]),
                                        ("all_attention_lm", [])])
def test_incremental_equals_full_and_reorder(lm_data, arch, extra):
    _, task, model, _ = _lm(lm_data, arch, extra)
    d = task.source_dictionary
    torch.manual_seed(2)
    tokens = torch.randint(d.nspecial, len(d), (4, 30))  # longer than S = 16: sliding window
    order = torch.tensor([1, 0, 3, 3])
    with torch.no_grad():
        full = model(tokens)[0][order]
        state = {}
        step, tokens = decode_steps(model, tokens, None, new_order=order, reorder_at=11,
                                    state=state)
        assert (full - model(tokens)[0]).abs().max() < 1e-5
        assert (step - full).abs().max() < 1e-5
        # the cache keeps only the window: S - 1 = 15 positions at most
        assert state and max(v.size(2) for k, v in next(iter(state.values())).items()
                             if k.startswith("k")) <= 15


def test_stream_cache_equals_one_long_forward(lm_data):
    """Blocks fed one after the other with stream_pos (Transformer-XL cache) == the whole
    sequence at once (eval mode; the cache keeps window + buffer >= window positions)."""
    _, task, model, _ = _lm(lm_data, extra=["--attn-span", "32", "--adaptive-span-ramp", "8",
                                            "--adaptive-span-trim-chunk", "8"])
    d = task.source_dictionary
    torch.manual_seed(3)
    tokens = torch.randint(d.nspecial, len(d), (3, 60))
    with torch.no_grad():
        whole = model(tokens)[0]
        parts = [model(tokens[:, i:i + 20], stream_pos=torch.full((3,), i // 20))[0]
                 for i in range(0, 60, 20)]
        assert (torch.cat(parts, 1) - whole).abs().max() < 1e-5
        # a block that does not continue the stream starts without cache
        fresh = model(tokens[:, 20:40], stream_pos=torch.full((3,), 7))[0]
        assert (fresh - model(tokens[:, 20:40])[0]).abs().max() < 1e-5
    model.train()  # training keeps its own cache: eval's is untouched
    assert {k[0] for k in model.decoder.stack.streams} == {"eval"}


_HOST_READS = {"__bool__", "__float__", "__int__", "__index__", "item", "tolist", "equal"}


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts reads of tensor values into Python (on a GPU each one is a synchronisation)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _HOST_READS:
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padded,kernel", [(False, "explicit"), (True, "explicit"),
                                           (True, "sdpa")])
def test_stream_forward_reads_the_host_a_fixed_number_of_times(lm_data, padded, kernel):
    """A training step (criterion forward, stream mode) reads device values into Python once,
    whatever the number of layers (before: three reads per layer and five in the criterion, then
    two: the flags and the window plan apart)."""
    from fairseq_attnzoo.tasks.stream_lm import StreamBatches

    reads = {}
    for layers in (2, 5):
        _, task, model, criterion = _lm(lm_data, extra=["--decoder-layers", str(layers),
                                                        "--adaptive-span-kernel", kernel])
        model.train()
        d = task.source_dictionary
        tokens = torch.randint(d.nspecial, len(d), (2000,), generator=torch.Generator()
                               .manual_seed(0)).numpy()
        batches = StreamBatches(tokens, batch_size=4, block=16)
        for i in range(2):  # the second block continues the first (cache used)
            sample = batches.collater([batches[i]])
            if padded:
                sample["net_input"]["src_tokens"][0, :3] = d.pad()
            with _HostReads() as counter:
                loss, _, _ = criterion(model, sample)
            loss.backward()
        reads[layers] = counter.names
    assert reads[2] == reads[5] and len(reads[5]) == 1, reads


def test_stream_batches_layout_and_sharding():
    tokens = torch.arange(1000).numpy()
    one = StreamBatches(tokens, batch_size=4, block=10)
    assert len(one) == math.ceil((250 - 1) / 10)
    b0 = one.collater([one[0]])
    b1 = one.collater([one[1]])
    src, tgt = b0["net_input"]["src_tokens"], b0["target"]
    assert torch.equal(src[:, 0], torch.tensor([0, 250, 500, 750]))  # 4 contiguous streams
    assert torch.equal(tgt[:, :-1], src[:, 1:])
    assert torch.equal(tgt[:, -1], b1["net_input"]["src_tokens"][:, 0])  # next block's first
    assert b1["net_input"]["stream_pos"].tolist() == [1] * 4
    last = one.collater([one[len(one) - 1]])
    assert last["target"][:, -1].tolist() == [249, 499, 749, 999]  # every token gets predicted
    # update k of: 1 worker with --update-freq 2 == 2 workers (fairseq's equivalence)
    accum = StreamBatches(tokens, batch_size=2, block=10, update_freq=2)
    shards = [StreamBatches(tokens, batch_size=2, block=10, num_shards=2, shard_id=r)
              for r in range(2)]
    for k in (0, 3):
        acc = [accum.collater([accum[2 * k + u]])["net_input"] for u in range(2)]
        ddp = [s.collater([s[k]])["net_input"] for s in shards]
        for a, b in zip(acc, ddp):
            assert all(torch.equal(a[key], b[key]) for key in a)
    assert accum.collater([accum[2]])["net_input"]["stream_id"].tolist() == [0, 1]


def test_criterion_reports_bits_and_adds_span_penalty(lm_data):
    args, task, model, criterion = _lm(lm_data)
    model.train()
    sample = next(iter(task.get_batch_iterator(_load(task, "valid"), max_sentences=4)
                       .next_epoch_itr(shuffle=False)))
    loss, sample_size, log = criterion(model, sample)
    with torch.no_grad():
        lprobs = F.log_softmax(model(**sample["net_input"])[0].float(), -1)
    nll = -lprobs.gather(-1, sample["target"].unsqueeze(-1)).sum()
    ntok = sample["target"].numel()
    assert sample_size == ntok == log["ntokens"]
    assert abs(float(log["loss"]) - float(nll)) < 1e-3
    penalty = float(span_penalty(model))
    assert penalty > 0 and abs(float(loss) - float(nll) - ntok * penalty) < 1e-3
    from fairseq.logging import metrics

    with metrics.aggregate() as agg:
        type(criterion).reduce_metrics([log])
    assert abs(agg.get_smoothed_values()["bpc"] - float(nll) / ntok / math.log(2)) < 1e-3
    assert abs(agg.get_smoothed_values()["span_avg"]
               - float(torch.cat(layer_spans(model)).mean())) < 0.1


def test_adagrad_clip_update():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    q = torch.nn.Parameter(torch.randn(3))
    opt = AdagradClip([p, q], lr=0.1, grad_clip=0.5)
    gp, gq = torch.randn(5) * 3, torch.full((3,), 0.01)
    p0, q0 = p.detach().clone(), q.detach().clone()
    p.grad, q.grad = gp.clone(), gq.clone()
    opt.step()
    # ||gp|| > clip: step scaled by clip / ||g||; q's gradient is below the clip
    expect_p = p0 - 0.1 * (0.5 / gp.norm()) * gp / (gp.abs() + 1e-10)
    expect_q = q0 - 0.1 * gq / (gq.abs() + 1e-10)
    assert torch.allclose(p.detach(), expect_p, atol=1e-6)
    assert torch.allclose(q.detach(), expect_q, atol=1e-6)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("clip", [0.0, 0.03])
def test_adagrad_clip_group_update_equals_one_tensor_at_a_time(clip, weight_decay):
    """The whole-group (_foreach) update is bit for bit the per-tensor update of the module
    docstring, over several steps, with a tensor that has no gradient in one of them."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (128,), (7, 5, 3)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    ref = [p.detach().clone() for p in params]
    sums = [torch.zeros_like(p) for p in ref]
    opt = AdagradClip(params, lr=0.07, grad_clip=clip, weight_decay=weight_decay)
    for it in range(4):
        grads = [torch.randn(*s) * (it + 1) for s in shapes]
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if (it == 2 and i == 1) else g.clone()
            if p.grad is None:
                continue
            g = g.add(ref[i], alpha=weight_decay) if weight_decay else g
            sums[i].addcmul_(g, g)
            update = g / sums[i].sqrt().add_(1e-10)
            if clip > 0:
                update.mul_((clip / (torch.linalg.vector_norm(g) + 1e-10)).clamp_(max=1.0))
            ref[i].add_(update, alpha=-0.07)
        opt.step()
    assert all(torch.equal(p.detach(), r) for p, r in zip(params, ref))
    assert all(torch.equal(opt.state[p]["sum"], s) for p, s in zip(params, sums))


def test_dynamic_span_learns_and_generation_samples(lm_data):
    _, task, model, criterion = _lm(lm_data, extra=["--adaptive-span-dynamic"])
    model.train()
    sample = next(iter(task.get_batch_iterator(_load(task, "valid"), max_sentences=4)
                       .next_epoch_itr(shuffle=False)))
    loss, _, _ = criterion(model, sample)
    loss.backward()
    proj = [m.span_proj for m in model.modules() if type(m).__name__ == "AdaptiveMask"]
    assert proj and all(p.weight.grad is not None and p.weight.grad.abs().sum() > 0 for p in proj)
    # fairseq's generator: sampling and beam search (reorder_incremental_state) both run
    from fairseq import search
    from fairseq.sequence_generator import SequenceGenerator

    model.eval()
    d = task.target_dictionary
    prefix = torch.randint(d.nspecial, len(d), (2, 5), generator=torch.Generator().manual_seed(0))
    for kw in ({"beam_size": 2},
               {"beam_size": 1, "search_strategy": search.Sampling(d, sampling_topk=5)}):
        gen = SequenceGenerator([model], d, max_len_b=12, min_len=12, **kw)
        hyps = gen.generate([model], {"net_input": {"src_tokens": prefix,
                                                    "src_lengths": torch.tensor([5, 5])}},
                            prefix_tokens=prefix, bos_token=d.eos())
        assert len(hyps) == 2 and all(h[0]["tokens"].numel() >= 12 for h in hyps), hyps
        assert torch.equal(hyps[0][0]["tokens"][:5], prefix[0])


# ---- the layer stack as a plain module, and the archs in the registry -------------------------

def test_stack_without_fairseq_streams_blocks_like_one_sequence():
    """AdaptiveSpanStack on its own (torch only): blocks with stream_pos == one long forward, the
    decoding cache == the same, and only eval's cache is kept."""
    from fairseq_attnzoo.modules.span_stack import AdaptiveSpanStack

    torch.manual_seed(0)
    stack = AdaptiveSpanStack(2, 16, 2, 32, max_span=12, cache_buffer=4, ramp=4, span_init=0.4,
                              trim_chunk=4, persistent_slots=3).eval()
    x = torch.randn(2, 30, 16)
    pad = torch.zeros(2, 30, dtype=torch.bool)
    with torch.no_grad():
        whole, inner = stack(x, pad)
        parts = [stack(x[:, i:i + 10], pad[:, i:i + 10], stream_pos=torch.full((2,), i // 10))[0]
                 for i in range(0, 30, 10)]
        state = {}
        steps = [stack.step(x[:, t:t + 1], pad[:, t:t + 1], state)[0] for t in range(30)]
    assert len(inner) == 3 and list(stack.streams) == [("eval", 0)]
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-5, atol=1e-5)
    assert max(state[f"k{i}"].size(2) for i in range(2)) <= 11  # the window, S - 1 at most
    stack.reset_streams()
    assert not stack.streams


# the documented table (docs/adaptive_span.md): layers, d, heads, FFN, N, S, dropout, lambda
ARCH_TABLE = {
    "adaptive_span_lm": (12, 512, 8, 2048, 0, 8192, 0.3, 5e-7),
    "adaptive_span_lm_small": (8, 256, 4, 1024, 0, 1024, 0.0, 2e-6),
    "adaptive_span_lm_large": (24, 768, 8, 4096, 0, 8192, 0.4, 5e-7),
    "all_attention_lm": (18, 512, 8, 0, 1024, 8192, 0.3, 1e-7),
    "all_attention_lm_large": (36, 512, 8, 0, 2048, 8192, 0.4, 1e-7),
}


@pytest.mark.parametrize("arch", sorted(ARCH_TABLE))
def test_span_archs_are_presets_in_the_arch_registry(arch):
    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    from fairseq_attnzoo.models.registry import BASE_ARCHS, arch_tests

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "/nonexistent", "--arch", arch, "--task", "attnzoo_stream_lm"])
    got = (args.decoder_layers, args.decoder_embed_dim, args.decoder_attention_heads,
           args.decoder_ffn_embed_dim, args.persistent_memory_size, args.attn_span, args.dropout,
           args.adaptive_span_loss)
    assert got == ARCH_TABLE[arch]
    # test hooks come from the registration, not from attributes of the model class
    cls = ARCH_MODEL_REGISTRY[arch]
    assert not any(hasattr(cls, a) for a in ("zoo_tiny", "zoo_test_flags", "zoo_cli_eval_flags"))
    assert any(MODEL_REGISTRY[m] is cls for m in BASE_ARCHS)  # its model has a base arch
    hooks = arch_tests(arch)
    assert hooks.flags == ("--criterion", "attnzoo_span_loss") and hooks.tiny["attn_span"] == 16
    assert hooks.tiny.get("persistent_memory_size") == (8 if "all_attention" in arch else None)


def test_register_arch_errors_name_the_problem():
    from fairseq_attnzoo.models.registry import register_arch

    with pytest.raises(ValueError, match="has no base arch: register it with register_base_arch"):
        register_arch("no_such_model", "no_such_arch")
    with pytest.raises(ValueError, match=r"unknown test hooks \['tolerance'\]"):
        register_arch("attnzoo_lm", "attnzoo_lm_bad_hooks", test={"tolerance": 1e-3})


def test_fairseq_train_with_sdpa_kernel_logs_the_same_losses(lm_data, tmp_path):
    """``fairseq-train --adaptive-span-kernel sdpa`` and ``explicit`` log the same losses update
    after update (stream task, span penalty, adagrad_clip; no dropout: the two paths draw their
    dropout masks differently), and the flag reaches the attention."""
    from zoo_testlib import json_logs, run_cli, tiny_flags, train_flags

    logs = {}
    for kernel in ("sdpa", "explicit"):
        arch = "adaptive_span_lm_small"
        lines = run_cli("train", tiny_flags(arch, lm_data) + train_flags(arch) + [
            "--optimizer", "adagrad_clip", "--lr", "0.07", "--max-tokens", "400",
            "--adaptive-span-kernel", kernel, "--dropout", "0", "--adaptive-span-init", "0.3",
            "--max-update", "4", "--no-save", "--disable-validation", "--log-interval", "1",
            "--log-format", "json", "--num-workers", "0", "--seed", "1",
            "--save-dir", str(tmp_path / kernel)])
        assert any(f"kernel={kernel}" in line for line in lines)  # the model as logged
        logs[kernel] = [float(r["loss"]) for r in json_logs(lines, "train_inner")]
    assert len(logs["sdpa"]) == 4
    assert logs["sdpa"] == pytest.approx(logs["explicit"], abs=1e-3)
