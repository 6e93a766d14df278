"""labs.env's start-up savings in the ranks change what DeepSpeed loads, never what it computes."""
import sys

from labs import env


def test_muon_stand_in_only_for_runs_without_muon(monkeypatch):
    monkeypatch.delitem(sys.modules, env.MUON_MODULE, raising=False)
    env.skip_muon_import({"optimizer": {"type": "Muon", "params": {}}})
    assert env.MUON_MODULE not in sys.modules                  # a Muon run gets DeepSpeed's real module
    env.skip_muon_import({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    stand_in = sys.modules[env.MUON_MODULE]
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam   # what DeepSpeed's engines import

    assert MuonWithAuxAdam is stand_in.MuonWithAuxAdam and not isinstance(object(), MuonWithAuxAdam)
    monkeypatch.delitem(sys.modules, env.MUON_MODULE)
