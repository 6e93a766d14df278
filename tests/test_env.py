"""labs.env's start-up savings in the ranks change what DeepSpeed loads, never what it computes."""
import os
import subprocess
import sys

import pytest

from labs import env


def test_muon_stand_ins_only_for_runs_without_muon(monkeypatch):
    for name in (env.MUON_MODULE, env.MUON_KERNELS):
        monkeypatch.delitem(sys.modules, name, raising=False)
    env.skip_muon_import({"optimizer": {"type": "Muon", "params": {}}})
    assert env.MUON_MODULE not in sys.modules and env.MUON_KERNELS not in sys.modules   # Muon gets DeepSpeed's own
    env.skip_muon_import({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam   # what DeepSpeed's engines import
    from deepspeed.runtime.zero.muon.original_muon import muon_update       # what ZeRO-1/2's gradient copy imports

    assert MuonWithAuxAdam is sys.modules[env.MUON_MODULE].MuonWithAuxAdam and not isinstance(object(), MuonWithAuxAdam)
    with pytest.raises(RuntimeError, match="not Muon"):                    # never silently a no-op update
        muon_update(None, None)
    for name in (env.MUON_MODULE, env.MUON_KERNELS):
        monkeypatch.delitem(sys.modules, name)


def test_labs_runs_moves_the_chapters_runs():
    """make test points LABS_RUNS at its temporary folder, so the chapters, run beside the unit tests, leave runs/ alone
    (tests/conftest.py fails any test that writes into the checkout)."""
    from labs import ROOT
    probe = [sys.executable, "-c", "import labs; print(labs.RUNS)"]
    env = {k: v for k, v in os.environ.items() if k != "LABS_RUNS"}
    default = subprocess.run(probe, capture_output=True, text=True, env=env, cwd=ROOT).stdout.strip()
    moved = subprocess.run(probe, capture_output=True, text=True, env=dict(env, LABS_RUNS="/tmp/elsewhere"),
                           cwd=ROOT).stdout.strip()
    assert (default, moved) == (str(ROOT / "runs"), "/tmp/elsewhere")
