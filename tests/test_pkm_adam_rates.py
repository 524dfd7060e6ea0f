"""pkm_adam's value rate and what it says (issue 64, items 2 and 5): --pkm-values-lr and
--pkm-values-lr-ratio together are refused in one line (the ratio used to win without a word);
under --bf16 (one fp32 master per parameter: pkm_adam takes no flat buffer) the values get their
own rate and nothing claims they are missing (fairseq's bf16 wrapper builds a probe optimizer on
one dummy parameter to ask whether it takes flat parameters, and that probe said "no product-key
memory values among the parameters")."""

import pytest

from fairseq_attnzoo.modules.pkm import ProductKeyMemory
from fairseq_attnzoo.optim.pkm_optimizer import PKMAdam, PKMAdamConfig
from zoo_testlib import json_logs, run_cli, tiny_flags


def test_values_lr_and_its_ratio_together_are_one_line():
    params = list(ProductKeyMemory(8, 8, n_keys=4, heads=1, knn=2, k_dim=4).parameters())
    with pytest.raises(ValueError) as e:
        PKMAdam(PKMAdamConfig(lr=[1e-3], pkm_values_lr=5e-3, pkm_values_lr_ratio=10.0), params)
    said = str(e.value)
    assert "--pkm-values-lr 0.005" in said and "--pkm-values-lr-ratio 10.0" in said, said
    assert "give one" in said and "\n" not in said
    for one in (dict(pkm_values_lr=5e-3), dict(pkm_values_lr_ratio=10.0), {}):  # each alone
        rates = [g["lr"] for g in PKMAdam(PKMAdamConfig(lr=[1e-3], **one), params).param_groups]
        assert rates == [1e-3, pytest.approx({"pkm_values_lr": 5e-3,
                                              "pkm_values_lr_ratio": 1e-2}.get(
                                                  next(iter(one), None), 1e-3))], (one, rates)


@pytest.mark.slow
def test_bf16_pkm_adam_trains_the_values_at_their_rate_without_a_false_line(lm_data, tmp_path):
    """fairseq-train --bf16 --optimizer pkm_adam: no "no product-key memory values" line, and the
    same losses as with --fp16-no-flatten-grads (which docs/pkm.md wrongly asked for)."""
    flags = tiny_flags("transformer_lm_pkm", lm_data) + [
        "--bf16", "--optimizer", "pkm_adam", "--lr", "0.002", "--pkm-values-lr", "0.02",
        "--max-tokens", "200", "--max-update", "2", "--no-save", "--seed", "1",
        "--save-dir", str(tmp_path), "--log-format", "json", "--log-interval", "1",
        "--disable-validation"]
    losses = []
    for more in ([], ["--fp16-no-flatten-grads"]):
        lines = run_cli("train", flags + more)
        assert not [line for line in lines if "no product-key memory values" in line], lines
        losses.append([r["loss"] for r in json_logs(lines, "train_inner")])
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses
