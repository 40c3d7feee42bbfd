"""The config list of the hard level's reference protocol: several LM-head precisions in one ablation
(--lm-head int8,fp8) and the approximate configs only on top of the exact switches
(--approximate-stacked); bad combinations are one-line errors (exit 2)."""

import sys

import pytest

from moebench.ablation import ablation_matrix
from moebench.measuring.args import RunArgs
from moebench.measuring.run import _exact_configs

PROTOCOL = dict(kernel="naive", scheduler="static", prefetch="off", ablate=True, factorial=False,
                axes="kernel,lm-head,weights", lm_head="int8,fp8", weights="f32", speculative="off",
                decode_path="auto", approximate_stacked=True)


def names(points):
    return [p.name for p in points]


def test_stacked_matrix_keeps_each_precision_once_on_the_switches():
    both = ablation_matrix(("kernel",), lm_heads=("int8", "fp8"), weights=("int8",))
    stacked = ablation_matrix(("kernel",), lm_heads=("int8", "fp8"), weights=("int8",), approximate_stacked=True)
    assert names(both) == ["baseline", "kernel", "lm-head=int8", "kernel+lm-head=int8", "lm-head=fp8",
                           "kernel+lm-head=fp8", "weights=int8", "kernel+weights=int8"]
    assert names(stacked) == ["baseline", "kernel", "kernel+lm-head=int8", "kernel+lm-head=fp8", "kernel+weights=int8"]
    # without a switch to stack on, the approximate configs stay alone
    assert names(ablation_matrix((), lm_heads=("fp8",), approximate_stacked=True)) == ["baseline", "lm-head=fp8"]


def test_protocol_args_give_the_protocol_configs():
    assert names(_exact_configs(RunArgs.from_dict(PROTOCOL))) == ["baseline", "kernel", "kernel+lm-head=int8",
                                                     "kernel+lm-head=fp8", "kernel+weights=int8"]
    alone = _exact_configs(RunArgs.from_dict(dict(PROTOCOL, approximate_stacked=False, axes="kernel,lm-head")))
    assert names(alone) == ["baseline", "kernel", "lm-head=int8", "kernel+lm-head=int8", "lm-head=fp8",
                            "kernel+lm-head=fp8"]
    # a manifest written before the option had no such key: the approximate configs alone too
    old = {k: v for k, v in PROTOCOL.items() if k != "approximate_stacked"}
    assert "lm-head=int8" in names(_exact_configs(RunArgs.from_dict(old)))


@pytest.mark.parametrize("extra, message", [
    (["--lm-head", "int8,fp8"], "several precisions need --ablate"),
    (["--ablate", "--axes", "kernel,lm-head", "--lm-head", "int8,f32"], "several precisions need --ablate, none of them f32"),
    (["--ablate", "--axes", "kernel,lm-head", "--lm-head", "int8,int3"], "--lm-head 'int3'"),
    (["--approximate-stacked"], "--approximate-stacked needs --ablate"),
    (["--ablate", "--axes", "kernel", "--approximate-stacked"], "--approximate-stacked needs a switch and lm-head"),
    (["--ablate", "--axes", "lm-head", "--approximate-stacked"], "--approximate-stacked needs a switch and lm-head"),
])
def test_bad_protocol_options_are_one_line_errors(extra, message, tmp_path, monkeypatch, capsys):
    from moebench.cli.app import main

    monkeypatch.setattr(sys, "argv", ["moebench", "run", "--suite", "gsm-synth-hard", "--limit", "2",
                                      "--out", str(tmp_path / "r"), *extra])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1, err
