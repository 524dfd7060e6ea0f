"""The extension point itself: vanilla equivalence with fairseq's stock models, the shared
attention base against fairseq's MultiheadAttention, and one-line errors for bad flags."""

import contextlib

import pytest
import torch

from zoo_testlib import DispatchedOps, build, parse

from fairseq_attnzoo.modules.attention import positions_from_padding
from fairseq_attnzoo.modules.sdpa import ZooMultiheadAttention


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


def _outputs(model, sample):
    model.eval()
    with torch.no_grad():
        return model(**sample["net_input"])[0]


def _sample(task, split="valid"):
    task.load_dataset(split)
    itr = task.get_batch_iterator(dataset=task.dataset(split), max_sentences=8, max_tokens=4096,
                                  seed=0).next_epoch_itr(shuffle=False)
    return next(iter(itr))


PAIRS = [
    # (stock arch, zoo arch, extra flags, data)
    ("transformer", "attnzoo_transformer", [], "mt"),
    ("transformer", "attnzoo_transformer",
     ["--encoder-normalize-before", "--decoder-normalize-before", "--share-all-embeddings"], "mt"),
    ("transformer", "attnzoo_transformer_sdpa", [], "mt"),
    ("transformer_lm", "attnzoo_lm", [], "lm"),
    ("transformer_lm", "attnzoo_lm_sdpa", ["--decoder-normalize-before"], "lm"),
]


@pytest.mark.parametrize("stock,zoo,extra,kind", PAIRS)
def test_vanilla_reproduces_stock_fairseq(stock, zoo, extra, kind, mt_data, lm_data):
    """Same parameter count, same names, identical outputs for the same weights."""
    data = mt_data if kind == "mt" else lm_data
    _, task, zoo_model, _ = build(zoo, data, extra)
    # the stock model gets exactly the same flags, only the arch differs
    stock_args = parse(zoo, data, extra)
    stock_args.arch = stock
    from fairseq.models import ARCH_CONFIG_REGISTRY

    ARCH_CONFIG_REGISTRY[stock](stock_args)
    torch.manual_seed(1)
    stock_model = task.build_model(stock_args)
    assert type(stock_model).__name__ in ("TransformerModel", "TransformerLanguageModel")
    assert _n_params(zoo_model) == _n_params(stock_model)
    zoo_model.load_state_dict(stock_model.state_dict(), strict=True)
    sample = _sample(task)
    a, b = _outputs(stock_model, sample), _outputs(zoo_model, sample)
    tol = 0.0 if zoo in ("attnzoo_transformer", "attnzoo_lm") else 1e-5
    assert (a - b).abs().max().item() <= tol


def _mha_pair():
    from fairseq.modules import MultiheadAttention

    torch.manual_seed(0)
    ref = MultiheadAttention(16, 4)
    zoo = ZooMultiheadAttention(16, 4)
    zoo.load_state_dict(ref.state_dict(), strict=True)
    return ref.eval(), zoo.eval()


def test_base_masks_match_fairseq_mha():
    ref, zoo = _mha_pair()
    torch.manual_seed(1)
    x = torch.randn(7, 3, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, :2] = True  # left padding
    pad[1, -3:] = True  # right padding
    future = torch.triu(torch.full((7, 7), float("-inf")), 1)
    for attn_mask in (None, future):
        r, _ = ref(x, x, x, key_padding_mask=pad, attn_mask=attn_mask, need_weights=False)
        z, _ = zoo(x, x, x, key_padding_mask=pad, attn_mask=attn_mask)
        keep = (~pad).t().unsqueeze(-1)
        assert ((r - z).abs() * keep).max() < 1e-6


def test_fully_masked_rows_stay_finite():
    _, zoo = _mha_pair()
    x = torch.randn(4, 2, 16)
    pad = torch.tensor([[True] * 4, [False] * 4])
    out, _ = zoo(x, x, x, key_padding_mask=pad)
    assert torch.isfinite(out).all()


def test_masks_are_derived_once_per_forward_and_again_when_they_change():
    """fairseq hands every layer of a forward the same padding and future-mask tensors: the
    additive mask and the pad-aware positions are derived from them once, not once per layer
    (a few kernel launches each), and derived anew from a mask changed in place or a new one."""
    from fairseq_attnzoo.modules import mask_scope
    from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

    torch.manual_seed(0)
    layers = [SynthesizerAttention(16, 4, components=("dense",), max_len=8) for _ in range(3)]
    x = torch.randn(7, 3, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, :2] = True

    def forward(mask, change=False):  # one pass: its layers inside one mask_scope
        with DispatchedOps() as ops, mask_scope():
            outs = [m(x, x, x, key_padding_mask=mask)[0] for m in layers]
            if change:  # changed in place inside the pass: derived anew
                mask[1, :3] = True
                outs = [m(x, x, x, key_padding_mask=mask)[0] for m in layers]
        return outs, ops.n["cumsum"], ops.n["masked_fill_"]

    first, positions, fills = forward(pad)
    assert (positions, fills) == (1, 1)  # one derivation for the three layers
    assert forward(pad)[1:] == (1, 1)  # the next pass derives its own
    changed, positions, fills = forward(pad, change=True)
    assert (positions, fills) == (2, 2)
    fresh = [m(x, x, x, key_padding_mask=pad.clone())[0] for m in layers]
    for a, b in zip(changed, fresh):
        assert torch.equal(a, b)
    assert not torch.equal(changed[0][:, 1], first[0][:, 1])


def test_the_decoders_future_mask_views_are_derived_once_per_forward():
    """fairseq's decoder hands each layer a new view of its one buffered future mask
    (``buffered_future_mask``: ``self._future_mask[:T, :T]``, sliced per layer): inside a
    forward's :func:`mask_scope` the masks are still derived once for all layers, from the view's
    base and place; a differently placed view of the same buffer is a different mask; without a
    scope each call derives its own."""
    from fairseq_attnzoo.modules import mask_scope
    from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

    torch.manual_seed(0)
    layers = [SynthesizerAttention(16, 4, components=("dense",), max_len=8) for _ in range(3)]
    buffered = torch.triu(torch.full((8, 8), float("-inf")), 1)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[2, 5:] = True  # right-padded targets

    def forward(t, scope=True):
        x = torch.randn(t, 3, 16)
        with DispatchedOps() as ops, mask_scope() if scope else contextlib.nullcontext():
            for m in layers:
                m(x, x, x, key_padding_mask=pad[:, :t], attn_mask=buffered[:t, :t])
            if scope:  # another place in the same buffer: derived anew
                y = x[:-1]
                layers[0](y, y, y, key_padding_mask=pad[:, :t - 1],
                          attn_mask=buffered[:t - 1, :t - 1])
        return ops.n["cumsum"], ops.n["masked_fill_"]

    assert forward(7) == (2, 2)  # one derivation for the three layers' views, one for the fourth
    assert forward(7, scope=False) == (3, 3)


def test_masks_derived_in_a_forward_are_dropped_with_it():
    """What is derived from a forward's masks lives as long as its pass (the zoo encoder's and
    decoder's forward open the scope), never in a process-wide cache: after the pass nothing
    holds the masks, and the next pass derives again."""
    import gc
    import weakref

    from fairseq_attnzoo.modules import attention
    from fairseq_attnzoo.modules.synthesizer import SynthesizerAttention

    assert not hasattr(attention, "_FROM_MASKS")
    m = SynthesizerAttention(16, 4, components=("dense",), max_len=8)
    x = torch.randn(7, 3, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, :2] = True
    with attention.mask_scope():
        with attention.mask_scope():  # a scope inside a scope is the outer one
            m(x, x, x, key_padding_mask=pad)
        assert len(attention._SCOPE.get()) > 0
    assert attention._SCOPE.get() is None
    ref = weakref.ref(pad)
    del pad
    gc.collect()
    assert ref() is None


def test_the_zoo_encoder_and_decoder_derive_masks_once_per_pass(mt_data):
    """A zoo translation model's forward (encoder and decoder) opens the scope: every mask
    derivation of its layers happens inside one (once for the pass, not once per layer)."""
    from fairseq_attnzoo.modules import attention

    seen = []
    derive = attention._derived

    def counting(masks, key, make):
        seen.append(attention._SCOPE.get() is not None)
        return derive(masks, key, make)

    _, task, model, _ = build("transformer_synth_dense", mt_data, ["--decoder-layers", "3"])
    sample = _sample(task)
    attention._derived = counting
    try:
        model(**sample["net_input"])
    finally:
        attention._derived = derive
    assert seen and all(seen)  # every derivation inside a pass's scope


def test_pad_aware_positions():
    pad = torch.tensor([[True, True, False, False], [False, False, False, True]])
    assert positions_from_padding(pad, 4).tolist() == [[0, 0, 0, 1], [0, 1, 2, 0]]
    assert positions_from_padding(None, 3).tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("flags,message", [
    (["--encoder-ffn", "nosuch"], "unknown --encoder-ffn name 'nosuch'; choose from: "),
    (["--encoder-ffn", "mha"], "--encoder-ffn 'mha' cannot be used as ffn"),
    (["--decoder-self-attn", "mha,mha,mha"], "--decoder-self-attn lists 3 names but the decoder has 2 layers"),
    (["--cross-self-attention"], "--cross-self-attention is not supported by attnzoo models"),
    (["--scale-attn"], "--scale-attn is not supported by attnzoo models"),
])
def test_bad_flags_give_one_line_errors(flags, message, mt_data, lm_data):
    arch, data = ("attnzoo_lm", lm_data) if "--scale-attn" in flags else ("attnzoo_transformer", mt_data)
    with pytest.raises(ValueError) as err:
        build(arch, data, flags)
    text = str(err.value)
    assert message in text and "\n" not in text


def test_cli_hint_for_missing_or_unbinarised_data(monkeypatch, tmp_path):
    from fairseq_attnzoo.messages.hints import hint_for

    monkeypatch.setattr("sys.argv", ["fairseq-train", str(tmp_path / "nope"), "--arch", "x"])
    err = FileNotFoundError(2, "No such file", str(tmp_path / "nope"))
    assert "does not exist" in hint_for(err)
    monkeypatch.setattr("sys.argv", ["fairseq-train", str(tmp_path), "--arch", "x"])
    err = FileNotFoundError(2, "No such file", str(tmp_path / "dict.de.txt"))
    assert "not a binarised fairseq data directory" in hint_for(err)
    assert "run fairseq-preprocess" in hint_for(Exception("Could not infer language pair, ..."))
    assert hint_for(ValueError("something else")) is None


def test_fairseq_train_on_missing_data_ends_with_one_line_hint(console_shims, tmp_path):
    import os
    import subprocess

    from zoo_testlib import USER_DIR

    exe = os.path.join(console_shims("fairseq-train"), "fairseq-train")  # (its own process)
    proc = subprocess.run([exe, str(tmp_path / "missing"), "--user-dir", USER_DIR, "--arch",
                           "attnzoo_transformer", "--cpu", "--max-tokens", "100"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fairseq-attnzoo: data directory") and "fairseq-preprocess" in last
