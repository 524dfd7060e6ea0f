"""A seventh method added from outside the package (docs/extension_point.md walks through it).

:func:`register_toy` registers, from this file alone, a toy self-attention (``toy``: one tied
query/key projection on the shared base, rotated under ``--rope``), a variant that declares no
incremental decoding (``toy_stepless``), and an arch ``transformer_lm_toy``. In a fresh
interpreter (the suite's own registries stay as the package makes them) the test checks that the
host takes what they declare, with no edit of the host:

* ``fairseq-train --arch transformer_lm_toy --rope`` trains (3 updates, finite losses) and every
  layer's toy attention was built with the RoPE base;
* ``attnzoo-archs`` lists the arch with its sublayer, ``attnzoo-archs transformer_lm_toy`` shows
  the toy's flag, and ``--list --method toy`` finds it;
* ``--rope``'s help and its refusal (``toy_stepless`` declares no rotation) name the toy among
  the methods that rotate;
* a decoding step of ``toy_stepless`` (``incremental=False``) is refused in one line.
"""

import json
import os
from dataclasses import dataclass, field

import torch.nn as nn

from console_server import SERVERS
from preptest_util import REPO

#: RoPE base each toy attention was built with (filled by the builder, in the child interpreter)
BUILT_THETAS = []


def register_toy():
    """The whole method: a module, its options, two registrations and an arch."""
    from fairseq.dataclass import FairseqDataclass

    from fairseq_attnzoo.models.registry import register_arch
    from fairseq_attnzoo.models.sublayers import register_sublayer, require
    from fairseq_attnzoo.models.transformer import host_rope_theta
    from fairseq_attnzoo.modules.attention import ZooAttention
    from fairseq_attnzoo.modules.rotary import RotaryEmbedding

    class ToyAttention(ZooAttention):
        """softmax(W x_q (W x_k)ᵀ / √d_h) x_v: one projection for queries and keys."""

        def __init__(self, embed_dim, num_heads, dropout, gain=1.0, rope_theta=None):
            super().__init__(embed_dim, num_heads, dropout)
            self.qk = nn.Linear(embed_dim, embed_dim)
            self.out = nn.Linear(embed_dim, embed_dim)
            self.gain = gain
            self.rotary = None if rope_theta is None else RotaryEmbedding(self.head_dim,
                                                                          rope_theta)

        def rotate(self, x, ctx, seq_dim=-2):
            return x if self.rotary is None else self.rotary(x, ctx.offset, seq_dim=seq_dim)

        def compute(self, x_q, x_kv, ctx):
            b, t, _ = x_kv.shape
            k = self.rotate(self.qk(x_kv).view(b, t, self.num_heads, self.head_dim), ctx,
                            seq_dim=-3).flatten(2)
            kv = ctx.cache(k=k, v=x_kv)  # keys rotated at their own positions, then cached
            q = self.rotate(self.split_heads(self.qk(x_q)), ctx) * self.gain
            o = ctx.attend(q, self.split_heads(kv["k"]), self.split_heads(kv["v"]))
            return self.out(self.merge_heads(o))

    @dataclass
    class ToyConfig(FairseqDataclass):
        toy_gain: float = field(default=1.0, metadata={
            "help": "gain g on the toy's queries (default 1)"})

        def validate(self):
            require(self, "toy_gain", self.toy_gain > 0, "positive")

    @register_sublayer("toy", slots=("self_attn",), options=ToyConfig, rope=True)
    def build_toy(spec):
        """toy attention: one tied query/key projection"""
        theta = host_rope_theta(spec)
        BUILT_THETAS.append(theta)
        return ToyAttention(spec.embed_dim, spec.num_heads, spec.attention_dropout,
                            spec.options.toy_gain, rope_theta=theta)

    @register_sublayer("toy_stepless", slots=("self_attn",), incremental=False)
    def build_toy_stepless(spec):
        """toy attention that declares no incremental decoding"""
        return ToyAttention(spec.embed_dim, spec.num_heads, spec.attention_dropout)

    register_arch("attnzoo_lm", "transformer_lm_toy", decoder_self_attn="toy")


CHILD = '''
import contextlib, io, json, sys, tempfile
import torch
import test_toy_method as toy
toy.register_toy()
import zoo_testlib as z
from fairseq_attnzoo.cli import archs
from fairseq_attnzoo.messages.errors import ZooConfigError
data = sys.argv[1]
result = {}

with tempfile.TemporaryDirectory() as d:
    logs = z.run_cli("train", z.sweep_train_flags("transformer_lm_toy", data, d, 3) + ["--rope"])
result["losses"] = [float(e["loss"]) for e in z.json_logs(logs, "train_inner")]
result["thetas"] = toy.BUILT_THETAS

def archs_output(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        archs.main(list(argv))
    return out.getvalue()
result["summary"] = archs_output()
result["detail"] = archs_output("transformer_lm_toy")
result["method"] = archs_output("--list", "--method", "toy")

import argparse
from fairseq_attnzoo.models.transformer import add_host_args
host = argparse.ArgumentParser()
add_host_args(host)
result["rope_help"] = next(a.help for a in host._actions if "--rope" in a.option_strings)

try:
    z.build("attnzoo_lm", data, ["--decoder-self-attn", "toy_stepless", "--rope"])
except ValueError as e:
    result["rope_refusal"] = str(e)
_, _, model, _ = z.build("attnzoo_lm", data, ["--decoder-self-attn", "toy_stepless"])
model.eval()
tokens = torch.tensor([[4, 5, 6]])
full = model.decoder(tokens)[0]  # a full pass runs
try:
    model.decoder(tokens[:, :1], incremental_state={})
except ZooConfigError as e:
    result["step_refusal"] = str(e)
print(json.dumps(result))
'''


def test_toy_method_registered_outside_the_package_trains_with_rope_and_is_listed(lm_data):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
               OMP_NUM_THREADS="1")
    # (as python -c, forked from a process that imported fairseq: tests/console_server.py)
    code, out, err = SERVERS.run("-c", [CHILD, lm_data], env=env, cwd=REPO, timeout=300,
                                 preload=("fairseq",))
    assert code == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])

    # fairseq-train --rope: 3 updates, and every layer's toy attention rotates
    assert len(got["losses"]) == 3 and all(0 < x < 100 for x in got["losses"])
    assert got["thetas"] and set(got["thetas"]) == {10000.0}

    # attnzoo-archs knows the arch, its sublayer and the toy's flag
    assert "transformer_lm_toy  [language_modeling, model attnzoo_lm]" in got["summary"]
    assert "decoder_self_attn: toy (all" in got["summary"]
    assert "toy: toy attention: one tied query/key projection" in got["detail"]
    assert "--toy-gain 1.0" in got["detail"]
    assert got["method"].split() == ["transformer_lm_toy"]

    # --rope's help and refusal list the methods that rotate, the toy among them
    assert "toy" in got["rope_help"].split("declare it: ")[1].split(")")[0].split(", ")
    refusal = got["rope_refusal"]
    assert refusal.startswith("--rope is not implemented for the toy_stepless self-attention")
    assert refusal.endswith(" or toy") and "\n" not in refusal

    # a method that declares no incremental state: the decoding step refused in one line
    assert got["step_refusal"].startswith("--decoder-self-attn toy_stepless cannot decode token "
                                          "by token")
    assert "\n" not in got["step_refusal"]


def test_toy_method_needs_no_host_edit_the_host_names_no_method():
    """The host (models/transformer.py, models/sublayers.py) decides nothing by a method's name:
    none is spelled in its strings or comments (what it needs to know of a method it reads from
    the registrations; the stock mha/ffn are its own, modules/sdpa.py its stock attention under
    --rope)."""
    import re
    import tokenize

    from fairseq_attnzoo.models.sublayers import SUBLAYER_REGISTRY

    methods = [n for n, e in SUBLAYER_REGISTRY.items() if e.builder is not None]
    assert {"sdpa", "collab", "synth", "pkm"} <= set(methods)
    for part in ("transformer.py", "sublayers.py"):
        with open(os.path.join(REPO, "fairseq_attnzoo", "models", part)) as f:
            words = " ".join(t.string for t in tokenize.generate_tokens(f.readline)
                             if t.type in (tokenize.STRING, tokenize.COMMENT))
        named = [n for n in methods if re.search(rf"\b{re.escape(n)}\b", words)]
        assert not named, f"models/{part} names the methods {named}"
